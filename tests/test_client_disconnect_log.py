"""A quiet console: a client that goes away (mid-body, while its answer is computed, mid-stream) is logged at
INFO in one line without a traceback; ERROR is for our own faults. Before the fix, a client that went away
mid-body was an ERROR with a full ``ClientDisconnect`` traceback and a 500."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from cluster_harness import config, ensure_ray, status, stub, wait_for

from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    ensure_ray()
    with BackgroundServer(config("quiet", replicas=1, gateway={"http_port": "any"})) as s:
        s.url = f"http://127.0.0.1:{s.http_port}"
        yield s


def vtoken_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("vtoken") or r.name.startswith("uvicorn")]


def assert_quiet_disconnect(caplog, needle: str) -> None:
    """One INFO line naming the disconnect, nothing at WARNING or above, no traceback anywhere."""
    records = vtoken_records(caplog)
    loud = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.WARNING]
    assert not loud, loud
    assert not [r for r in records if r.exc_info], "a traceback was logged"
    lines = [r for r in records if needle in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in records]
    assert "\n" not in lines[0].getMessage()


def blocks_free(served) -> None:
    def free() -> bool:
        t = status(stub(served.port))["totals"]
        return t["free_blocks"] == t["total_blocks"] and t["running"] == 0

    wait_for(free, 10, 0.05, what="all blocks free after the disconnect")


def test_a_client_gone_mid_body_is_one_info_line(served, caplog):
    caplog.set_level(logging.INFO)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n"
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.http_port), timeout=10) as s:
            s.sendall(head + b'{"messages": [{"role": "user", "content": "')
            time.sleep(0.2)
    wait_for(lambda: sum("mid-body" in r.getMessage() for r in caplog.records) >= 3, 10, what="three log lines")
    time.sleep(0.3)  # anything else the server logs about them
    records = vtoken_records(caplog)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING or r.exc_info]
    assert [r.levelno for r in records if "mid-body" in r.getMessage()] == [logging.INFO] * 3
    assert httpx.post(served.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}).status_code == 200


def test_a_client_gone_while_waiting_or_mid_stream_is_one_info_line(served, caplog):
    body = {"messages": MSG, "max_tokens": 400}
    caplog.set_level(logging.INFO)
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as c, pytest.raises(httpx.ReadTimeout):
        c.post(served.url + "/v1/chat/completions", json=body)
    wait_for(lambda: any("while waiting" in r.getMessage() for r in caplog.records), 10, what="the log line")
    blocks_free(served)
    assert_quiet_disconnect(caplog, "while waiting")

    caplog.clear()
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)]
    wait_for(lambda: any("mid-stream" in r.getMessage() for r in caplog.records), 10, what="the log line")
    blocks_free(served)
    assert_quiet_disconnect(caplog, "mid-stream")
