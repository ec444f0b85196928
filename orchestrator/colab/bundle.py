"""What is uploaded to a runtime: this orchestrator's own source and the job's folder, each as
one tar file (``colab upload`` sends files, not folders).

The source is this very package, so the runtime runs the version that drives it, put on the
``PYTHONPATH`` there rather than pip-installed: pip never sees it, so it can replace nothing of
the image (TensorFlow, JAX, libtpu, Keras). The job's folder is the one its file is in, as
``orchestrator run`` finds the job's modules beside the file.
"""
from __future__ import annotations

import os
import tarfile

SKIP_DIRS = {"__pycache__", ".git", ".venv", "runs", "colab-runs", ".pytest_cache"}
MAX_JOB_BYTES = 64 * 1024 * 1024


def _skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = info.name.split("/")
    if any(p in SKIP_DIRS for p in parts) or info.name.endswith(".pyc"):
        return None
    return info


def source_bundle(dest: str) -> str:
    """This package's source, as ``orchestrator/...`` in a gzipped tar at ``dest``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # orchestrator/
    with tarfile.open(dest, "w:gz") as t:
        t.add(package, arcname="orchestrator", filter=_skip)
    return dest


def job_bundle(job_dir: str, dest: str) -> str:
    """The job's folder (its file and modules; run directories, caches and git left out) at
    ``dest``. ValueError naming the folder when it is too large to send every runtime."""
    total = 0
    for root, dirs, files in os.walk(job_dir):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if not os.path.islink(os.path.join(root, f)))
    if total > MAX_JOB_BYTES:
        raise ValueError(f"{job_dir}: the job's folder holds {total / 2**20:.0f} MiB; each new "
                         f"runtime gets a copy, so keep it under {MAX_JOB_BYTES // 2**20} MiB "
                         f"(put data on Drive and read it from /content/drive)")
    with tarfile.open(dest, "w:gz") as t:
        t.add(job_dir, arcname=".", filter=_skip)
    return dest

# The orchestrator's own requirements (pyproject.toml's [project] dependencies; a test keeps
# the two the same): installed in a runtime only when missing there, never a framework.
REQUIRES = ("cloudpickle>=3.0", "numpy>=1.24", "pydantic>=2.7", "pyyaml>=6.0", "tenacity>=8.2",
            "tqdm>=4.66", "watchdog>=4.0", "xxhash>=3.0")
