"""A Ray worker node of the test cluster, on a loopback address of its own and with a private /tmp.

Run as ``unshare --mount --propagation private python ray_node.py IP GCS_ADDRESS NUM_CPUS``:
in its own mount namespace (started by ``unshare``; root in the tests' container) it mounts a
tmpfs on ``/tmp`` and becomes ``ray start --block`` for a node at ``IP``. Ray's sockets and
session, the orchestrator's local control folder and local checkpoint tier then live on that
node's own "disk", which neither the supervisor nor the other node sees: as on real machines,
only what is outside ``/tmp`` (the run directory) is shared. SIGTERM stops the node (``--block``
drains its processes); the tmpfs goes with the namespace's last process.
"""
import os
import subprocess
import sys


def main() -> None:
    ip, gcs, cpus = sys.argv[1:4]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", "/tmp"], check=True)
    os.execv(sys.executable, [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                              f"--address={gcs}", f"--node-ip-address={ip}",
                              f"--num-cpus={cpus}", "--disable-usage-stats"])


if __name__ == "__main__":
    main()
