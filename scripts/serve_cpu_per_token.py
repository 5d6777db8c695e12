"""Where a streamed token's CPU goes: every process's CPU time per output token, stock vLLM's OpenAI server
against `vtoken serve` (the servers of `vtoken bench serve`, same model, engine settings and KV pool).

    PYTHONPATH=. .venv/bin/python scripts/serve_cpu_per_token.py --out /tmp/servecpu

One streamed completion at a time (``--requests`` of ``--tokens`` tokens each, greedy, ignore_eos), so a
token's cost is not shared with a batch. Each process's user+system time (/proc/PID/stat) is read before and
after, over every process on the machine, and divided by the tokens streamed; TPOT is each request's
(last token - first token) / (tokens - 1) as the client saw it. On a CPU machine vLLM's EngineCore and its
Worker each spin on a core while a request runs, so on 2 cores every other process's CPU time per token is
taken from the forward: that is what this script shows. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtoken.bench import serve  # noqa: E402


def cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (command line, user+system seconds) for every process readable now."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        name = cmd or stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(p)] = (" ".join(name.split())[:80], (int(fields[11]) + int(fields[12])) / tick)
    return out


def measure(url: str, model: str, requests: int, tokens: int) -> dict:
    import httpx

    body = {"model": model, "prompt": "Tell me a long story about a cat. " * 8, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(timeout=600) as c:
        for _ in range(2):  # warm-up
            c.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 16}).raise_for_status()
        before, t0, tpots = cpu_times(), time.monotonic(), []
        for _ in range(requests):
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                stamps = [time.monotonic() for line in r.iter_lines() if line.startswith("data: {")]
            tpots.append(1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
        wall, after = time.monotonic() - t0, cpu_times()
    n = requests * tokens
    per = {}
    for pid, (cmd, t) in after.items():
        spent = t - before.get(pid, (cmd, 0.0))[1]
        if spent > 0:
            per[cmd] = per.get(cmd, 0.0) + 1e3 * spent / n
    rows = sorted(((round(ms, 3), cmd) for cmd, ms in per.items() if ms >= 0.05), reverse=True)
    tpots.sort()
    return {
        "tpot_ms": tpots,
        "tpot_median_ms": tpots[len(tpots) // 2],
        "wall_s": wall,
        "cpu_ms_per_token": rows,
        "cpu_ms_per_token_total": round(sum(per.values()), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="stock,off", help="any of stock, off, vtoken (vtoken bench serve's)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args()
    from vtoken.models import model_path

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # as `vtoken bench serve`: the EngineCore in its own process
    defaults = argparse.ArgumentParser()
    serve.add_args(defaults)  # the servers exactly as `vtoken bench serve` builds them by default
    cfg = defaults.parse_args(["--model", args.model])
    folder, result = str(model_path(args.model)), {"command": " ".join(sys.argv), "servers": {}}
    for name in args.servers.split(","):
        print(f"[cpu] {name}: {args.requests} streams of {args.tokens} tokens", flush=True)
        with serve.server(cfg, name, folder) as url:
            result["servers"][name] = r = measure(url, args.model, args.requests, args.tokens)
        print(f"[cpu] {name}: TPOT {r['tpot_median_ms']:.1f} ms, {r['cpu_ms_per_token_total']:.1f} CPU ms/token")
        for ms, cmd in r["cpu_ms_per_token"][:10]:
            print(f"    {ms:7.3f}  {cmd}")
    result["loadavg_after"] = os.getloadavg()[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_cpu.json").write_text(json.dumps(result, indent=1))
    print(f"[cpu] wrote {out / 'serve_cpu.json'}")


if __name__ == "__main__":
    main()
