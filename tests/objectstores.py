"""Real object-store servers on loopback for the integration tier: ``gcp-storage-emulator`` (the
GCS JSON API, a process of its own, objects kept on disk so a test can change their bytes behind
the server's back) and moto's server (S3, ``ThreadedMotoServer`` in this process: its backend
is this process's memory, so it keeps its buckets across a stop and a start, and a test can
change an object's bytes without the server recomputing its ETag).

Each server is on 127.0.0.1 at a free port; ``env()`` is what a client (this process or a
supervisor started by a test) needs to reach it through the libraries' own settings.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import random
import socket

BUCKET = "ckpt"


def restartable_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range: the outage tests stop a server and start
    it again on its port 10 s later, and a port from the ephemeral range was taken in between
    by some process's outgoing connection (the emulator "exited with 1 before answering", seen
    in a suite run)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {max(1024, low - 12000)}..{low - 1}")


def _wait_answering(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # an HTTP answer, whatever its status, is a server answering
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in {timeout} s") from None
            time.sleep(0.1)


class GcsEmulator:
    """``gcp-storage-emulator`` as a process we started (stopped by its own Popen handle)."""

    scheme = "gs"

    def __init__(self, data_dir: str):
        self.data_dir, self.port, self.proc = data_dir, restartable_port(), None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> "GcsEmulator":
        with open(f"{self.data_dir}.stderr", "ab") as err:  # why it exited, if it does
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gcp_storage_emulator", "-d", self.data_dir, "start",
                 "--host", "127.0.0.1", "--port", str(self.port), "--default-bucket", BUCKET,
                 "-q"], stdout=subprocess.DEVNULL, stderr=err)
        try:
            _wait_answering(f"{self.endpoint}/storage/v1/b", proc=self.proc)
        except RuntimeError as exc:
            with open(f"{self.data_dir}.stderr", "rb") as f:
                tail = f.read()[-600:].decode(errors="replace")
            raise RuntimeError(f"{exc}; its stderr ends: {tail}") from None
        return self

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Stopped as Ctrl-C stops it: it ends the request under way, then exits. SIGTERM
        could cut its one metadata file (``.meta``, rewritten in place at each write) to
        nothing, and the next start then exited with 1: 3 of 40 stops in a loop of writes,
        and the outage test failed twice in suite runs; with SIGINT, 0 of 40."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def env(self) -> dict:
        """The emulator's address, no credentials, and gcsfs's plain client: its default one
        first asks the bucket's layout over gRPC, which the emulator does not serve (a 60 s
        timeout per call); read when gcsfs is first imported."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def options(self) -> dict:
        return {"token": "anon", "endpoint_url": self.endpoint}

    def object_file(self, name: str) -> str:
        """Where the emulator keeps an object's bytes on disk."""
        return os.path.join(self.data_dir, ".cloudstorage", BUCKET, name)

    def overwrite_stored(self, name: str, data: bytes) -> None:
        with open(self.object_file(name), "wb") as f:
            f.write(data)


class MotoS3:
    """moto's S3 server in this process, with one bucket."""

    scheme = "s3"
    CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1"}

    def __init__(self):
        self.port, self.server, self.started_once = restartable_port(), None, False
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoS3":
        """moto's own ``start`` waits for ever when its server thread dies binding the port: a
        suite run hung there, that thread gone. A first start takes another port, up to three
        times; a restart (the outage tests: the same port) fails naming it."""
        for n in range(1 if self.started_once else 3):
            if n:
                self.port = restartable_port()
                self.endpoint = f"http://127.0.0.1:{self.port}"
            if self._started():
                self.started_once = True
                return self
        raise RuntimeError(f"moto's S3 server did not start on port {self.port} (its thread died "
                           f"binding it, or 30 s passed)")

    def _started(self, timeout: float = 30.0) -> bool:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        starting = threading.Thread(target=server.start, daemon=True)
        starting.start()
        deadline = time.monotonic() + timeout
        while starting.is_alive():  # until the server is ready, or its thread died binding
            inner = getattr(server, "_thread", None)  # moto's server thread
            died = inner is not None and inner.ident is not None and not inner.is_alive()
            if died or time.monotonic() > deadline:  # (ident: it was started, then ended)
                return False
            starting.join(0.05)
        self.server = server
        _wait_answering(f"{self.endpoint}/moto-api/")
        return True

    def create_bucket(self) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None

    def close(self) -> None:
        """Stop, and forget every bucket: moto's backend is this process's, and the next
        test's server must start empty."""
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset",
                                                      method="POST"), timeout=10).close()
        self.stop()

    def env(self) -> dict:
        return {"AWS_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
                **self.CREDENTIALS}

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def encrypt_with_kms(self, monkeypatch) -> None:
        """The bucket's default encryption SSE-KMS, its objects' ETags then as S3 gives them:
        "Objects encrypted by SSE-C or SSE-KMS have ETags that are not an MD5 digest of their
        object data" (S3 API reference, Object). moto keeps the MD5 for those too; AWS's form
        is put in at moto's boundary (another 32 hex digits, a multipart one's ``-N`` kept)."""
        import boto3
        import hashlib
        from moto.s3.models import FakeKey

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1"
                     ).put_bucket_encryption(Bucket=BUCKET, ServerSideEncryptionConfiguration={
                         "Rules": [{"ApplyServerSideEncryptionByDefault": {
                             "SSEAlgorithm": "aws:kms"}}]})
        md5_etag = FakeKey.etag

        def kms_etag(key):
            etag = md5_etag.fget(key)
            if key.encryption != "aws:kms":
                return etag
            other = hashlib.md5(b"kms" + etag.encode()).hexdigest()
            parts = etag.strip('"').partition("-")[2]
            return f'"{other}-{parts}"' if parts else f'"{other}"'

        monkeypatch.setattr(FakeKey, "etag", property(kms_etag))

    def overwrite_stored(self, name: str, data: bytes) -> None:
        """Change the bytes moto holds for an object and leave its ETag as it was."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets[BUCKET].keys[name]
        etag = key.etag
        key._value_buffer.seek(0)
        key._value_buffer.truncate()
        key._value_buffer.write(data)
        key._etag = etag.strip('"')
