"""Reaching a Ray cluster in its authentication mode, bounded (supervise/rayconnect.py).

A stand-in GCS on 127.0.0.1 (a plain gRPC server answering GetClusterId as Ray's does: with
``UNAUTHENTICATED`` when it holds a token and the request does not carry it), so these need
neither Ray running nor anything beyond loopback. The real cluster, with a token, is
tests/test_e2e_multiworker.py's.
"""
import time
from concurrent import futures

import grpc
import pytest

from orchestrator.supervise import rayconnect


class FakeGcs:
    def __init__(self, token=None):
        self.token, self.calls = token, []

        def cluster_id(request, context):
            got = dict(context.invocation_metadata()).get("authorization")
            self.calls.append(got)
            if self.token and got != f"Bearer {self.token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "InvalidAuthToken: Authentication token is missing or incorrect")
            return b"\x0a\x07cluster"  # GetClusterIdReply {cluster_id}

        handler = grpc.method_handlers_generic_handler("ray.rpc.NodeInfoGcsService", {
            "GetClusterId": grpc.unary_unary_rpc_method_handler(cluster_id)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def gcs():
    made = []

    def make(token=None):
        made.append(FakeGcs(token))
        return made[-1]

    yield make
    for g in made:
        g.server.stop(0)


@pytest.fixture(autouse=True)
def _no_token_here(monkeypatch, tmp_path):
    """Nothing from this machine's ~/.ray or environment: each test says what it has."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _deadline(s=10.0):
    return time.monotonic() + s


def test_a_cluster_without_tokens_is_connected_to_without_one(gcs):
    g = gcs()
    assert rayconnect.auth_mode(g.address, _deadline()) == "disabled"
    assert g.calls == [None]


def test_a_cluster_with_a_token_is_connected_to_with_ours(gcs, monkeypatch, tmp_path):
    g = gcs(token="s3cret")
    path = tmp_path / "home" / ".ray" / "auth_token"
    path.parent.mkdir(parents=True)
    path.write_text("s3cret\n")  # what an earlier ray.init() leaves in ~/.ray
    assert rayconnect.auth_mode(g.address, _deadline()) == "token"
    assert g.calls == [None, "Bearer s3cret"]
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret")  # the environment comes first
    path.write_text("stale")
    assert rayconnect.auth_mode(g.address, _deadline()) == "token"


def test_a_cluster_with_a_token_and_none_here_is_one_clear_line(gcs):
    g = gcs(token="s3cret")
    with pytest.raises(rayconnect.ConnectError) as e:
        rayconnect.auth_mode(g.address, _deadline())
    msg = str(e.value)
    assert "requires token authentication and no token was found" in msg
    assert "\n" not in msg and "auth_token" in msg


def test_a_token_that_is_not_the_clusters_is_named(gcs, monkeypatch):
    g = gcs(token="s3cret")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "other")
    with pytest.raises(rayconnect.ConnectError, match=r"refused the token from \$RAY_AUTH_TOKEN"):
        rayconnect.auth_mode(g.address, _deadline())


def test_a_mode_set_here_that_the_cluster_refuses_is_named(gcs, monkeypatch):
    g = gcs(token="s3cret")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret")
    with pytest.raises(rayconnect.ConnectError, match="RAY_AUTH_MODE=disabled here"):
        rayconnect.auth_mode(g.address, _deadline())


def test_no_cluster_at_the_address_fails_within_the_bound():
    import socket
    import threading

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    got = {}

    def connect():
        t0 = time.monotonic()
        try:
            rayconnect.connect(address, timeout_s=1.5)
        except rayconnect.ConnectError as exc:
            got["error"] = str(exc)
        got["s"] = time.monotonic() - t0

    t = threading.Thread(target=connect, daemon=True)  # an unbounded connect fails, not hangs
    t.start()
    t.join(20)
    assert not t.is_alive(), "connect did not return within 20 s of a 1.5 s bound"
    assert "no answer from the Ray cluster's GCS" in got["error"]
    assert 1.4 < got["s"] < 4.0  # retried until the bound, not beyond


@pytest.mark.parametrize("address", [None, "auto", "ray://head:10001"])
def test_addresses_ray_resolves_itself_are_not_probed(address):
    assert rayconnect.gcs_address(address) is None
