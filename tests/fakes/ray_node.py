"""A Ray worker node of the test cluster, on a loopback address of its own and with a private /tmp.

Run as ``unshare --mount --propagation private python ray_node.py IP GCS_ADDRESS NUM_CPUS``:
in its own mount namespace (started by ``unshare``; root in the tests' container) it mounts a
tmpfs on ``/tmp`` (where its Python or the source were made in /tmp, they stay visible: a
fresh clone there found no Python, and no node started) and becomes ``ray start --block`` for
a node at ``IP``. Ray's sockets and session, the orchestrator's local control folder and local
checkpoint tier then live on that node's own "disk", which neither the supervisor nor the other
node sees: as on real machines, only what is outside ``/tmp`` (the run directory) is shared. SIGTERM stops the node (``--block``
drains its processes); the tmpfs goes with the namespace's last process.
"""
import os
import subprocess
import sys


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _under_tmp(paths) -> list[str]:
    """The folders directly under /tmp that hold this node's Python or the source (a clone or
    a virtual environment made in /tmp): the private /tmp would hide them."""
    tops = set()
    for p in paths:
        parts = os.path.realpath(p).split(os.sep)
        if len(parts) > 2 and parts[1] == "tmp":
            tops.add(os.path.join("/tmp", parts[2]))
    return sorted(tops)


def private_tmp() -> None:
    """A tmpfs on /tmp, with this node's Python and the source bound back into it: they are
    held on a tmpfs on /mnt (this namespace's own) while /tmp is replaced."""
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    keep = _under_tmp([source, sys.prefix, sys.executable])  # nothing else of /tmp
    if keep:
        _mount("-t", "tmpfs", "tmpfs", "/mnt")
        for i, path in enumerate(keep):
            os.mkdir(f"/mnt/{i}")
            _mount("--bind", path, f"/mnt/{i}")
    _mount("-t", "tmpfs", "-o", "size=4g", "tmpfs", "/tmp")
    for i, path in enumerate(keep):
        os.mkdir(path)
        _mount("--move", f"/mnt/{i}", path)


def main() -> None:
    ip, gcs, cpus = sys.argv[1:4]
    private_tmp()
    os.execv(sys.executable, [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                              f"--address={gcs}", f"--node-ip-address={ip}",
                              f"--num-cpus={cpus}", "--disable-usage-stats"])


if __name__ == "__main__":
    main()
