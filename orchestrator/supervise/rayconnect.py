"""How the supervisor reaches a Ray cluster: bounded, and in the cluster's authentication mode.

Ray (2.52 on) may protect a cluster with a token (``RAY_AUTH_MODE=token``; the token from
``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``), and
a driver must connect in the cluster's mode. Ray does not tell a driver which mode that is:
``ray start --head`` turns tokens on by itself when ``~/.ray/auth_token`` exists (an earlier
local ``ray.init()`` writes one), while ``ray.init(address=...)`` with an explicit address
keeps them off. Such a driver was refused (``InvalidAuthToken``) at every retry of its
connection loop and the run never started, with nothing in the journal.

So before ``ray.init`` the GCS is asked once, over plain gRPC and with a deadline, for its
cluster id: an answer without a token says tokens are off; ``UNAUTHENTICATED`` says they are
on, and the same question with our token says whether it is the cluster's. The mode is then
set where Ray reads it (``RAY_AUTH_MODE`` in this process's environment, before Ray reads its
configuration). A mode the user set is kept, and a mismatch is named. Every way to fail is one
line (``RayUnavailable``), and the whole connection is bounded by ``timeout_s``: the probe
retries an unreachable GCS until then, and Ray's own connection loop is given what is left
(``RAY_gcs_server_port_wait_time_s``, which Ray honours as its GCS wait).

An address Ray resolves itself (none: a new local Ray; ``auto``; ``ray://`` for Ray Client) is
not probed: Ray's own rule applies there, still within the bound.
"""
from __future__ import annotations

import os
import sys
import time

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
_CLUSTER_ID = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # an empty request, any mode


class ConnectError(RuntimeError):
    """The cluster cannot be reached, or not in a mode we can authenticate in (one line)."""


def token() -> tuple[str | None, str]:
    """(our token, where it came from), in Ray's order of precedence; (None, where we looked)."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    path = os.environ.get(TOKEN_PATH_ENV) or os.path.join(os.path.expanduser("~"), ".ray",
                                                           "auth_token")
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError:
        value = ""
    where = f"${TOKEN_PATH_ENV} ({path})" if os.environ.get(TOKEN_PATH_ENV) else path
    return (value or None), where


def gcs_address(address: str | None) -> str | None:
    """``host:port`` of the GCS to probe, or None for an address Ray resolves itself."""
    if not address or address in ("auto", "local") or "://" in address:
        return None
    return address


def probe(address: str, deadline: float, with_token: str | None = None) -> str | None:
    """Ask the GCS at ``address`` for its cluster id until ``deadline`` (monotonic). None: it
    answered; "unauthenticated": it refused the request as sent; else why it did not answer."""
    import grpc  # Ray's own dependency; no Ray import, so no Ray configuration is read yet

    metadata = [("authorization", f"Bearer {with_token}")] if with_token else None
    last = "no attempt"
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        call = channel.unary_unary(_CLUSTER_ID)  # bytes in, bytes out: the request is empty
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return last
            try:
                call(b"", timeout=min(left, 5.0), metadata=metadata)
                return None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return "unauthenticated"
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def auth_mode(address: str, deadline: float) -> str:
    """The mode to connect to the GCS at ``address`` in: ``token`` or ``disabled``."""
    chosen = os.environ.get(AUTH_MODE_ENV, "").strip().lower() or None
    found = probe(address, deadline)
    if found is None:
        return chosen or "disabled"
    if found != "unauthenticated":
        raise ConnectError(f"no answer from the Ray cluster's GCS at {address} "
                           f"({found}); is the cluster up, and is this its address?")
    if chosen not in (None, "token"):
        raise ConnectError(f"the Ray cluster at {address} requires token authentication, "
                           f"and {AUTH_MODE_ENV}={chosen} here: unset it or set it to token")
    value, where = token()
    if value is None:
        raise ConnectError(f"the Ray cluster at {address} requires token authentication and "
                           f"no token was found (${TOKEN_ENV}, then ${TOKEN_PATH_ENV}, then "
                           f"{where}): `ray get-auth-token` on the head node prints it")
    if probe(address, deadline, with_token=value) is not None:
        raise ConnectError(f"the Ray cluster at {address} refused the token from {where}: "
                           f"it is not this cluster's")
    return "token"


def connect(address: str | None, timeout_s: float, **init_kw) -> dict:
    """Connect this process as Ray's driver within ``timeout_s``; what was connected to (the
    address, the authentication mode, the seconds it took). Raises ``ConnectError``."""
    t0 = time.monotonic()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a notebook that connected itself: as it is
        return {"address": address or "local", "auth": "as connected before", "connect_s": 0.0}
    deadline = t0 + timeout_s
    mode = os.environ.get(AUTH_MODE_ENV) or "Ray's default"
    gcs = gcs_address(address)
    if gcs is not None:
        mode = auth_mode(gcs, deadline)
        _set_mode(mode)
    import ray

    left = max(1, int(deadline - time.monotonic()))
    wait_before = os.environ.get(GCS_WAIT_ENV)
    if wait_before is None:  # Ray's GCS wait, one try a second, bounded by ours
        os.environ[GCS_WAIT_ENV] = str(left)
    try:
        ray.init(address=address, ignore_reinit_error=True, **init_kw)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConnectError(f"cannot connect to Ray at {address or 'a new local Ray'} "
                           f"(authentication: {mode}, {time.monotonic() - t0:.0f} s of "
                           f"{timeout_s:g}): {line}") from exc
    finally:
        if wait_before is None:
            os.environ.pop(GCS_WAIT_ENV, None)
    return {"address": address or "local", "auth": mode,
            "connect_s": round(time.monotonic() - t0, 3)}


def _set_mode(mode: str) -> None:
    """Where Ray reads the mode: this process's environment, read with the rest of its
    configuration. Ray read it already if it was imported: it is read again then, as Ray's
    own switch to token mode does (``Config.initialize``)."""
    if os.environ.get(AUTH_MODE_ENV) == mode:
        return
    os.environ[AUTH_MODE_ENV] = mode
    if "ray._raylet" in sys.modules:
        sys.modules["ray._raylet"].Config.initialize("")
