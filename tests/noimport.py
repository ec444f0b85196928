"""A Python that cannot import some packages: what a TPU VM (no TensorFlow) or a broken install
looks like to the code under test, in a child process.

``env_without(folder, *packages)`` writes a ``sitecustomize.py`` into ``folder`` that puts a
finder first on ``sys.meta_path``: any import of those packages (or their submodules) raises
``ModuleNotFoundError`` naming the package, as a missing install does, and
``importlib.util.find_spec`` raises it too (``core/backends.installed`` then says: not
installed). It returns the environment whose ``PYTHONPATH`` puts that folder first (and the
repository, so the child imports this checkout). Every import the child attempted is appended
to ``folder/attempted.txt``, so that a test can also prove its code never tried.
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SITECUSTOMIZE = """\
import sys
_BLOCKED = {blocked!r}
_LOG = {log!r}
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in _BLOCKED:
            with open(_LOG, 'a') as f:
                f.write(name + '\\n')
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, _Blocked())
"""


def env_without(folder, *packages: str, base=None) -> dict:
    """The environment of a child Python that cannot import ``packages``."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    log = os.path.join(folder, "attempted.txt")
    with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_SITECUSTOMIZE.format(blocked=tuple(packages), log=log))
    base = dict(os.environ if base is None else base)
    return dict(base, PYTHONPATH=os.pathsep.join([folder, ROOT]))


def attempted(folder) -> list[str]:
    """The blocked imports the child attempted, in order."""
    try:
        with open(os.path.join(str(folder), "attempted.txt"), encoding="utf-8") as f:
            return f.read().split()
    except FileNotFoundError:
        return []
