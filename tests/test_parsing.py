"""Parsing off the event loop (cluster/parsing.py): the loop never runs a parse, a slow parse neither holds up
other work on the loop nor the other workers' requests, its request is refused past the time bound (413 / 503),
and the workers never keep the process alive. No Ray, no engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from cluster.parsing import ParseBusy, ParsePool, ParseTooLong


def spin(seconds: float) -> str:
    """Pure Python work that holds the GIL between switches, as a chat template's rendering does."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return "done"


def test_a_parse_runs_in_a_worker_and_its_result_or_error_comes_back():
    async def main():
        pool = ParsePool(workers=1, timeout_s=5)
        loop_thread = threading.get_ident()
        where = await pool.run(threading.get_ident)
        assert where != loop_thread
        with pytest.raises(ValueError, match="bad body"):
            await pool.run(lambda: (_ for _ in ()).throw(ValueError("bad body")))
        pool.close()

    asyncio.run(main())


def test_a_slow_parse_keeps_nobody_waiting_and_is_refused_past_its_bound():
    async def main():
        pool = ParsePool(workers=2, timeout_s=1.0)
        slow = asyncio.ensure_future(pool.run(spin, 3.0))
        await asyncio.sleep(0.05)
        gaps, t = [], time.monotonic()
        while not slow.done():  # the loop's own work (a /health, a stream) meanwhile
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - t)
            t = time.monotonic()
        quick = await asyncio.wait_for(pool.run(len, "abc"), 1.0)  # the other worker serves at once
        with pytest.raises(ParseTooLong, match="parse_timeout_s"):
            await slow
        assert quick == 3 and max(gaps) < 1.0, f"the loop waited {max(gaps):.3f} s (the bound: a second)"
        pool.close()

    asyncio.run(main())


def test_when_every_worker_is_busy_a_waiting_parse_is_unavailable_not_too_long():
    async def main():
        pool = ParsePool(workers=1, timeout_s=0.5, max_pending=1)
        busy = asyncio.ensure_future(pool.run(spin, 1.5))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(pool.run(len, "x"))
        await asyncio.sleep(0.05)
        with pytest.raises(ParseBusy, match="max_parse_pending"):
            await pool.run(len, "y")  # one waits already
        with pytest.raises(ParseBusy, match="no parse worker was free"):
            await waiting
        with pytest.raises(ParseTooLong):
            await busy
        await asyncio.sleep(1.2)  # the busy worker finishes and skips the abandoned job
        assert pool.waiting == 0 and await pool.run(len, "zz") == 2
        pool.close()

    asyncio.run(main())


def test_a_parse_that_never_ends_does_not_keep_the_process_from_exiting():
    code = (
        "import asyncio, time\n"
        "from cluster.parsing import ParsePool\n"
        "async def main():\n"
        "    pool = ParsePool(workers=1, timeout_s=0.2)\n"
        "    try:\n"
        "        await pool.run(time.sleep, 3600)\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__)\n"
        "asyncio.run(main())\n"
    )
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ParseTooLong", out.stderr[-2000:]
    assert time.monotonic() - t < 30
