"""Runs the engine on fixed configurations of the tiny random Llama and writes every request's tokens,
log-probabilities (bit-exact, as hex), trace line and the engine's stats to one JSON file, so that a change meant
to leave behaviour alone (a move of modules, a refactor) can be checked to the bit against the tree before it:

    .venv/bin/python scripts/engine_fingerprint.py before.json     # on the old tree
    .venv/bin/python scripts/engine_fingerprint.py after.json      # on the new one
    cmp before.json after.json

The configurations cover eviction at a budget (h2o, random and scissorhands per request, streaming with chunked
prefill), Naive-Evict, pressure mode with sheds and parking, preemptions, and prefix caching."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

EVICT = {"budget": 0.5, "sink": 2, "recent": 4}
PRESSURE = {"mode": "vtoken", "policy": "h2o", "budget": 64, "sink": 2, "recent": 8, "prefill_chunk": 32}
SHORT = dict(n=8, max_tokens=150, kv_bytes=24 * 65536, max_model_len=512)
CONFIGS: dict[str, tuple[dict, dict]] = {
    "h2o_always": ({"mode": "vtoken", "policy": "h2o", **EVICT}, {}),
    "naive_always": ({"mode": "naive", "policy": "h2o", **EVICT}, {}),
    "per_request_policies": (
        {"mode": "vtoken", "policy": "h2o", **EVICT},
        {"options": [None, {"policy": "random"}, {"policy": "scissorhands"}, {"budget": 0.25}]},
    ),
    "streaming_chunked": ({"mode": "vtoken", "policy": "streaming", "prefill_chunk": 32, **EVICT}, {}),
    "pressure_sheds_parking": ({**PRESSURE, "evict": "pressure", "park_tokens": 4096}, SHORT),
    "snapkv_pressure": ({**PRESSURE, "policy": "snapkv", "evict": "pressure", "park_tokens": 4096}, SHORT),
    "always_preemptions": ({**PRESSURE, "evict": "always", "park_tokens": 4096}, SHORT),
    "naive_preemptions": ({**PRESSURE, "mode": "naive", "evict": "always"}, SHORT),
    "floor_per_request": (
        {**PRESSURE, "evict": "pressure", "park_tokens": 4096},
        {**SHORT, "options": [{"pressure_floor": 0.5} if i % 2 else None for i in range(8)]},
    ),
    "default_pressure": ({"mode": "vtoken", "evict": "pressure"}, {}),
    "prefix_caching": ({"mode": "vtoken", "policy": "h2o", **EVICT}, {"shared_prefix": 64}),
}


def fingerprint(name: str, cfg: dict, kw: dict) -> dict:
    from vllm_harness import prompts, run

    from vtoken.models import model_path

    kw = dict(kw)
    n = kw.pop("n", 3)
    ps = prompts(n, lengths=(70, 130, 45, 100))
    options = kw.pop("options", None)
    if options:
        ps = [ps[i % n] for i in range(len(options))]
    shared = kw.pop("shared_prefix", 0)
    if shared:
        ps = [ps[0][:shared] + p for p in ps]
    r = run(
        str(model_path("tiny-llama")),
        cfg,
        ps,
        trace_dir=Path(tempfile.mkdtemp()),
        options=options,
        enable_prefix_caching=bool(shared),
        **kw,
    )
    return {
        "tokens": r.tokens,
        "logprobs": [[float(x).hex() for x in lp] for lp in r.logprobs],
        "trace": r.trace,
        "stats": {k: v for k, v in r.stats.items() if not k.endswith("_seconds")},  # timings vary run to run
        "preemptions": r.metrics.get("vllm:num_preemptions"),
    }


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = {}
    for i, (name, (cfg, kw)) in enumerate(CONFIGS.items(), 1):
        t = time.time()
        out[name] = fingerprint(name, cfg, kw)
        print(f"[{i}/{len(CONFIGS)}] {name}: {sum(map(len, out[name]['tokens']))} tokens, "
              f"preemptions {out[name]['preemptions']}, {time.time() - t:.0f} s", flush=True)  # fmt: skip
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
    print(f"wrote {sys.argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
