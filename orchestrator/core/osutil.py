"""Small OS helpers: durable atomic writes and process liveness, shared by both sides."""
from __future__ import annotations

import hashlib
import json
import os


def fsync_dir(path: str) -> bool:
    """Persist a directory entry (a rename or a new file) where the OS allows it.

    Returns False where the filesystem refuses (some FUSE mounts do for directories): the
    rename is then as durable as that filesystem makes it, and there is nothing more to do.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, durable: bool = True, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so a reader sees the old or the new content, never half.

    ``mode``: the new file is created with it (the umask may take bits away, never add any),
    not widened first and narrowed later (a leftover temporary file is removed, not reused)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if mode is None:
        f = open(tmp, "wb")
    else:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb")
    with f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def write_json_atomic(path: str, obj, durable: bool = True) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, default=str) + "\n").encode(), durable)


def read_json(path: str):
    """The JSON in ``path``, or None when it is missing or unreadable (being replaced)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_missing(path: str) -> bool:
    """``path`` does not exist, for sure: False when it exists *or* cannot be looked at (a
    Drive mount that is down answers ENOTCONN, which is no proof of absence)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def file_size(path: str) -> int:
    """Its size; 0 for a file not there yet. Any other OSError (a run directory whose mount
    is gone) is the caller's to see."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def complete_lines(data: bytes) -> bytes:
    """``data`` up to its last newline: a torn last line (a writer killed mid-line, or one still
    writing) waits for its end."""
    end = data.rfind(b"\n")
    return data[:end + 1] if end >= 0 else b""


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo``'s fields in bytes (``MemAvailable``, ``MemTotal``, ...). Raises
    ``OSError`` where it cannot be read, ``ValueError`` where a line is not ``Key: N kB``."""
    with open(path, encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k.strip(): int(v.split()[0]) * 1024 for k, v in fields.items()}
