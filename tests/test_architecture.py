"""The two-process design as checked contracts (pyproject.toml [tool.importlinter]): only
train/ imports TensorFlow, JAX or Keras, at module level or inside a function; the supervisor's
side never imports train/; the packages depend one way."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint_imports(config: str | None = None):
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or \
        shutil.which("lint-imports")
    assert exe, "import-linter is a test dependency (pip install -e '.[test]')"
    cmd = [exe, "--no-cache"] + (["--config", config] if config else [])
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


@pytest.mark.integration
def test_import_contracts_hold():
    p = _lint_imports()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["tensorflow", "jax"])
def test_a_framework_import_inside_a_supervisor_function_breaks_the_contract(tmp_path,
                                                                              framework):
    # the same contracts over a copy of the package with one function-level import added
    pkg = tmp_path / "src" / "orchestrator"
    shutil.copytree(os.path.join(ROOT, "orchestrator"), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = pkg / "supervise" / "hangs.py"
    target.write_text(target.read_text() + f"\n\ndef _sneaky():\n    import {framework}\n")
    config = tmp_path / "pyproject.toml"
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), config)
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or \
        shutil.which("lint-imports")
    p = subprocess.run([exe, "--no-cache", "--config", str(config)], capture_output=True,
                       text=True, cwd=tmp_path / "src",
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "src")))
    assert p.returncode != 0, p.stdout + p.stderr
    assert f"orchestrator.supervise.hangs -> {framework}" in p.stdout


@pytest.mark.integration
def test_a_circle_reintroduced_in_the_worker_breaks_the_layers_contract(tmp_path):
    # datasets.py <-> epochdata.py was one, dodged with function-local imports
    pkg = tmp_path / "src" / "orchestrator"
    shutil.copytree(os.path.join(ROOT, "orchestrator"), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = pkg / "train" / "epochdata.py"
    target.write_text(target.read_text() + "\n\ndef _leaves(part):\n"
                      "    from orchestrator.train.datasets import leaves\n"
                      "    return leaves(part)\n")
    config = tmp_path / "pyproject.toml"
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), config)
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or \
        shutil.which("lint-imports")
    p = subprocess.run([exe, "--no-cache", "--config", str(config)], capture_output=True,
                       text=True, cwd=tmp_path / "src",
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "src")))
    assert p.returncode != 0, p.stdout + p.stderr
    assert "The worker's modules, top to bottom BROKEN" in p.stdout
    assert "orchestrator.train.epochdata -> orchestrator.train.datasets" in p.stdout


# the worker's modules that import Keras at their top: imported from a function, each with a
# "# here: ..." reason, so that Keras loads only once configure has set its backend up
FRAMEWORK_LOADERS = {"orchestrator.train.callbacks", "orchestrator.train.tensorboard"}


def test_the_worker_imports_its_own_modules_from_a_function_only_to_keep_keras_unloaded():
    import ast

    bad = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "orchestrator", "train")):
        for name in (n for n in names if n.endswith(".py")):
            path = os.path.join(dirpath, name)
            lines = open(path).read().splitlines()
            for fn in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, ast.ImportFrom) or not (
                            node.module or "").startswith("orchestrator"):
                        continue
                    targets = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                    if not (targets & FRAMEWORK_LOADERS and "# here:" in lines[node.lineno - 1]):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not bad, bad


def test_every_journal_event_is_named_from_the_one_vocabulary():
    # events are written as Event.X (core/events.py), never as a string literal somewhere
    import ast

    from orchestrator.core.events import ALL

    literal = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "orchestrator")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("append", "iter") and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value in ALL):
                    literal.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not literal, literal


def test_no_file_holds_merge_conflict_markers():
    """A merge committed with its conflict markers once left ARCHITECTURE.md half-written."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    bad = []
    for path in _files_below(root):
        if path.suffix not in (".py", ".md", ".toml", ".yaml", ".yml", ".sh") or any(
                part.startswith(".") or part.endswith(".egg-info") for part in path.parts):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                bad.append(f"{path.relative_to(root)}:{n}")
    assert not bad, bad


def _files_below(root):
    """Every file below ``root``, without descending into the folders the check skips anyway
    (``.venv``, ``.git``, ``*.egg-info``): walking .venv's thousands of files took 3 s."""
    import pathlib

    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info")]
        for name in names:
            yield pathlib.Path(dirpath, name)


def test_no_import_cycle():
    """Two modules that import each other cannot be read, tested or replaced one at a time:
    core/spec.py and specload.py did, and spec.py reached up into checkpoint/store.py (for
    Retention, now core/retention.py); train/ had three, dodged with function-local imports."""
    import grimp

    graph = grimp.build_graph("orchestrator", cache_dir=None)
    cycles = sorted({tuple(sorted((a, b))) for a in graph.modules
                     for b in graph.find_modules_directly_imported_by(a)
                     if b.startswith("orchestrator.")
                     and graph.chain_exists(importer=b, imported=a)})
    assert not cycles, cycles
