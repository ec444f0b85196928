"""One file through the bucket tier against a plain ``fs.put_file`` of the same file, on the GCS
emulator and moto's S3 (the servers of tests/objectstores.py, on loopback): what our checksum
(computed before the upload, then compared with the server's) costs over the library's own
upload. Not a timed test: ``python -m bench.objectstore_put [--mib 1024]``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from objectstores import BUCKET, GcsEmulator, MotoS3  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--only", choices=("gs", "s3"))
    args = ap.parse_args(argv)
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    from orchestrator.checkpoint.objectstore import FsspecPlace

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.bin")
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        servers = {"gs": lambda: GcsEmulator(os.path.join(tmp, "gcs")), "s3": MotoS3}
        for scheme, make in servers.items():
            if args.only not in (None, scheme):
                continue
            srv = make().start()
            try:
                if isinstance(srv, MotoS3):
                    srv.create_bucket()
                # moto joins a 1 GB multipart upload for longer than botocore's 60 s read
                # timeout on a loaded machine (its retry then meets the upload gone)
                extra = {"config_kwargs": {"read_timeout": 900}} if scheme == "s3" else {}
                place = FsspecPlace(f"{srv.scheme}://{BUCKET}/bench", **srv.options(), **extra)
                raw = _timed(lambda: place.fs.put_file(path, f"{place.root}/raw"))
                place.delete("raw")  # the server holds one copy at a time (moto: in memory)
                ours = _timed(lambda: place.write_file("blob", path))
                print(f"{srv.scheme}: {args.mib} MiB  fs.put_file {raw:.1f} s  "
                      f"FsspecPlace.write_file {ours:.1f} s  ({ours / raw:.2f}x)", flush=True)
            finally:
                srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
