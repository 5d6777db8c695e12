"""Getting a Ray: a local one of our own, or a cluster joined on purpose, within a deadline, with one line when
it fails. `vtoken serve` and the benchmarks (through ``cluster.server.start_ray``) both come here.

* **No address: a local Ray of our own** (``ray.init(address="local")``). A plain ``ray.init()`` joins whatever
  it finds first: ``RAY_ADDRESS``, or the address ``ray start`` wrote to ``/tmp/ray/ray_current_cluster``,
  even when that cluster was killed long ago (its GCS then never answers, and ``ray.init`` retries for minutes).
  Joining is what ``--address`` (or ``ray.address``) is for, ``auto`` included.
* **An address: ask its GCS first.** One small gRPC call (``GetClusterId``, what Ray's own clients send first)
  tells in milliseconds whether anything answers there and whether it wants Ray's token. Ray 2.60 turns token
  authentication on for a head whenever a token exists on its machine (``ray start --head`` after any local
  ``ray.init``), but never for a client given an explicit address, so joining such a head failed after ~30 s
  with a 57-line traceback. Here, a head that wants a token gets the one Ray itself would read
  (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), as Ray does for a cluster it found by
  itself; a token that is missing or wrong is one line naming the mode, the address and the fix.
* **A deadline** (``ray.connect_timeout_s``) on the whole of it, ``ray.init`` included: ``RayUnavailable``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger("vtoken.server")
TOKEN_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


class RayUnavailable(RuntimeError):
    """No Ray could be had: one line with what failed, the address, the authentication mode and the fix."""


class Probe(NamedTuple):
    status: str  # "ok", "unauthenticated", "unreachable"
    detail: str  # gRPC's own words when not ok


def auth_mode() -> str:
    """RAY_AUTH_MODE as this process has it ("unset": Ray then sends no token to an explicit address)."""
    return os.environ.get("RAY_AUTH_MODE") or "unset"


def token_source() -> str | None:
    """Where Ray would read this machine's token from, in Ray's order; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH ({path})" if Path(path).is_file() else None
    return "~/.ray/auth_token" if (Path.home() / ".ray" / "auth_token").is_file() else None


def _token() -> str | None:
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # it caches; the environment may have changed since
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True)


def probe(address: str, token: str | None, timeout_s: float = 3.0) -> Probe:
    """One call to the GCS at ``address``: does it answer, and does it take ``token`` (None: send none)?"""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata
            )
            return Probe("ok", "")
        except grpc.RpcError as e:
            detail = (e.details() or e.code().name).splitlines()[0]
            status = "unauthenticated" if e.code() == grpc.StatusCode.UNAUTHENTICATED else "unreachable"
            return Probe(status, detail)


def resolve(address: str) -> str:
    """host:port of ``address``; ``auto`` is the cluster Ray finds itself (RAY_ADDRESS, then the one ``ray start``
    recorded on this machine), as ``ray.init(address="auto")`` reads it."""
    if address.startswith("ray://"):
        raise RayUnavailable(
            f"--address {address}: Ray Client addresses are not served; run vtoken serve on a node of the cluster "
            "with --address HOST:PORT (the GCS port, 6379 by default)"
        )
    from ray._private.services import canonicalize_bootstrap_address

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as e:
        raise RayUnavailable(f"--address {address}: {str(e).splitlines()[0]}") from None
    if resolved is None:
        raise RayUnavailable(f"--address {address}: no Ray cluster found to join (start one: ray start --head)")
    return resolved


def check_auth(address: str, deadline: float, shown: str | None = None) -> str:
    """Wait (until ``deadline``, time.monotonic()) for the GCS at ``address`` to answer, and make sure this process
    will send the token it wants. Returns how it authenticates, for the progress line. Raises RayUnavailable
    naming the address as ``shown`` (the user's words; Ray resolves 127.0.0.1 to the node's address)."""
    shown = shown or address
    mode = auth_mode()
    token = _token() if mode == "token" else None
    while True:
        p = probe(address, token, timeout_s=max(0.5, min(3.0, deadline - time.monotonic())))
        if p.status != "unreachable":
            break
        if time.monotonic() >= deadline:
            raise RayUnavailable(
                f"cannot reach Ray at {shown} ({p.detail}; auth mode {mode}): start the head there "
                f"(ray start --head --port={shown.rsplit(':', 1)[-1]}) or give the head's address with --address"
            )
        time.sleep(0.5)
    if p.status == "ok":
        return f"with token authentication (token from {token_source()})" if token else "without authentication"
    # The head wants a token this process did not send, or refused the one it sent.
    source = token_source()
    fix = (
        f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<the head's token: `ray get-auth-token` on the head> ({TOKEN_DOCS})"
    )
    if token is not None:
        raise RayUnavailable(f"Ray at {shown} refused the token from {source} (auth mode token): {fix}")
    if mode not in ("unset", "token"):
        raise RayUnavailable(f"Ray at {shown} requires token authentication (auth mode {mode}): {fix}")
    if source is None:
        raise RayUnavailable(
            f"Ray at {shown} requires token authentication and this machine has no token (auth mode {mode}, no "
            f"RAY_AUTH_TOKEN, no ~/.ray/auth_token): {fix}"
        )
    # What Ray does for a cluster it finds by itself (maybe_enable_token_auth_if_token_available): a token on this
    # machine switches token mode on, for this process and what it starts; without Ray's console warning.
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()
    if probe(address, _token()).status != "ok":
        raise RayUnavailable(f"Ray at {shown} refused the token from {source} (auth mode unset, then token): {fix}")
    log.info("Ray at %s wants token authentication: using the token from %s", shown, source)
    return f"with token authentication (token from {source})"


def within(deadline: float, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread, waited for until ``deadline`` (then RayUnavailable naming ``what``).
    ``ray.init`` can block for minutes inside Ray's C++ client, where neither a timeout nor Ctrl-C reaches it;
    waiting here in short joins keeps the caller's thread free to hear both. A thread left behind holds Ray's
    half-made state, so after RayUnavailable or KeyboardInterrupt the caller exits the process (cluster/cli.py)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        done.set()
        if "error" not in box:
            # A local Ray's processes are started with PR_SET_PDEATHSIG, which Linux fires when the *thread* that
            # started them ends, not the process: this thread stays (parked, a daemon) as long as the process.
            threading.Event().wait()

    threading.Thread(target=run, name="ray-connect", daemon=True).start()
    while not done.wait(0.1):
        if time.monotonic() >= deadline:
            raise RayUnavailable(what)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def init_kwargs(cfg, verbose: bool) -> dict[str, Any]:
    from cluster.control.lifecycle import replica_env

    kw: dict[str, Any] = {
        "namespace": cfg.ray.namespace,
        "include_dashboard": False,
        "runtime_env": {"env_vars": replica_env()},
    }
    if not verbose:
        kw.update(log_to_driver=False, logging_level=logging.ERROR)
    return kw


def quiet_driver_messages() -> None:
    """Ray's driver prints what the raylets publish (a worker died, a node was lost: several hundred characters
    each) to stdout from a thread of its own, whatever ``log_to_driver`` says. Quiet (`vtoken serve` without
    --verbose), they go to the log file instead, as Ray's other messages do; our own line says what happened.
    Ray is pinned (pyproject.toml), so the function replaced here is known: ray._private.worker's printer."""
    import ray._private.worker as worker

    ray_log = logging.getLogger("ray")

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", ()):
            ray_log.warning("(%s) %s", data.get("pid", ""), line)

    worker.print_to_stdstream = to_log


def connect(cfg, address: str | None = None, verbose: bool = True) -> str:
    """Join ``address`` (or cfg.ray.address), else start a local Ray of our own, within
    ``cfg.ray.connect_timeout_s``. Returns one line saying which (for the progress output). Raises
    RayUnavailable; a Ctrl-C meanwhile is a KeyboardInterrupt, as anywhere in the main thread."""
    import ray

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not verbose:
        quiet_driver_messages()
    address = address or cfg.ray.address
    timeout = cfg.ray.connect_timeout_s
    deadline = time.monotonic() + timeout
    kw = init_kwargs(cfg, verbose)
    if not address:
        within(
            deadline,
            f"a local Ray did not start within {timeout:.0f}s (ray.connect_timeout_s); its logs: "
            f"{os.path.join(os.environ.get('TMPDIR', '/tmp'), 'ray', 'session_latest', 'logs')}",
            lambda: ray.init(address="local", num_cpus=cfg.ray.num_cpus, **kw),
        )
        return f"started a local Ray (node {ray.get_runtime_context().get_node_id()[:8]})"
    # resolve() may look the node's address up (Ray's resolve_ip_for_localhost): off the main thread too
    addr = within(deadline, f"resolving {address} took longer than {timeout:.0f}s", lambda: resolve(address))
    shown = addr if address == "auto" else address
    # check_auth's own deadline message is the better one (what answered, the fix): this one is a backstop
    how = within(deadline + 5, f"Ray at {shown} did not answer within {timeout:.0f}s",
                 lambda: check_auth(addr, deadline, shown))  # fmt: skip
    mode = auth_mode()

    def join():
        try:
            ray.init(address=addr, **kw)
        except ray.exceptions.AuthenticationError as e:
            raise RayUnavailable(f"Ray at {shown} refused this process (auth mode {mode}): {e.message}") from None
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailable(f"cannot join Ray at {shown} (auth mode {mode}): {str(e).splitlines()[0]}") from None

    within(deadline, f"joining Ray at {shown} took longer than {timeout:.0f}s (ray.connect_timeout_s; auth mode "
           f"{mode})", join)  # fmt: skip
    return f"joined Ray at {shown} {how}, node {ray.get_runtime_context().get_node_id()[:8]}"
