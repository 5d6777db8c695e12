"""What `vllm serve` answers, `vtoken serve` answers (issue 47, item 4): every feature of vtoken/bench/parity.py sent
with the `openai` client to stock vLLM's OpenAI server and to `vtoken serve` with vToken off, on tiny-llama: the
same greedy answers (texts, finish reasons, token counts, tool calls, log-probabilities within 1e-3), the same
refusals. The full table, with vToken's defaults and a reasoning parser: docs/results/parity.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_vtoken_serve_answers_every_feature_as_stock_vllm_serve(tmp_path):
    from vtoken.bench.parity import CASES, failures

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, as a user's first run
    r = subprocess.run([sys.executable, "-m", "vtoken.bench", "parity", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=840, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "parity.json").read_text())
    assert [row["feature"] for row in out["rows"]] == list(CASES)
    assert not failures(out, "off"), failures(out, "off")
    served = [row["feature"] for row in out["rows"] if row["stock"] == "served"]
    assert len(served) >= len(CASES) - 5, "stock served the features the table claims"
    a = out["answers"]["stock"]
    assert a["chat"]["ok"]["choices"][0]["text"], "a real answer, not two empty ones"
    assert a["responses store"]["ok"]["retrieved"] and a["error: model"]["error"] == 404


def test_the_comparison_can_fail():
    """Negative controls: another text, a log-probability off by more than the tolerance, a refusal against an
    answer, another status."""
    from vtoken.bench.parity import _verdict, same

    base = {"ok": {"choices": [{"text": "a b", "finish": "length"}], "logprobs": [-1.0, -2.0]}}
    assert same(base, json.loads(json.dumps(base)))
    assert not same(base, {"ok": {"choices": [{"text": "a c", "finish": "length"}], "logprobs": [-1.0, -2.0]}})
    assert not same(base, {"ok": {"choices": [{"text": "a b", "finish": "length"}], "logprobs": [-1.0, -2.01]}})
    assert same(base, {"ok": {"choices": [{"text": "a b", "finish": "length"}], "logprobs": [-1.0, -2.0004]}})
    assert _verdict({"error": 400}, base).startswith("DIFFERS")
    assert _verdict({"error": 400}, {"error": 404}).startswith("DIFFERS")
    assert _verdict({"ok": {"t": "x"}}, {"ok": {"t": "y"}}) == "same shape, other text"
