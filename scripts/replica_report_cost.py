"""What one replica report costs: ``vtoken_stats`` (what replicas polled until now) against ``pool_report``
(what they poll now), with N requests running, on a vToken engine.

    PYTHONPATH=. python scripts/replica_report_cost.py --running 64 --finished 1000

Two measurements, each per report (median and p90 over ``--calls`` calls, the two kinds interleaved):
  * rpc: the call as a replica makes it, through AsyncLLM's utility RPC to its EngineCore process while the
    requests decode (includes waiting for the step under way, which both kinds pay alike);
  * direct: the EngineCore-side function alone, in this process, between steps (no RPC, no step), the size of
    what it returns once serialised (msgpack, as the RPC carries it) and the time to serialise and parse it.
``--finished`` first completes that many four-token requests, so vtoken_stats carries its (up to 1000)
finished-request records, as on a server that has run a while.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))]}


def engine_args(args) -> dict:
    return dict(
        dtype="float32",
        block_size=32,
        max_model_len=args.prompt_tokens + args.max_tokens + 64,
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_mib << 20,
        max_num_seqs=max(args.running, 8),
        enable_prefix_caching=False,
        seed=0,
    )


def direct(args, folder: str, cfg) -> dict:
    """In-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0): time the two scheduler functions alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vtoken.vllm_adapter import open_llm, pool_report, vtoken_stats

    with open_llm(folder, cfg, **engine_args(args)) as llm:
        if args.finished:
            llm.generate(
                [TokensPrompt(prompt_token_ids=[5 + i % 50] * 8) for i in range(args.finished)],
                SamplingParams(max_tokens=4, ignore_eos=True),
                use_tqdm=False,
            )
        eng = llm.llm_engine
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.running):
            eng.add_request(f"run-{i}", TokensPrompt(prompt_token_ids=[7 + i % 90] * args.prompt_tokens), params)
        for _ in range(40):  # prefill everything and decode past the budget, so eviction has happened
            eng.step()
        report = pool_report(llm)
        assert report.running == args.running, report
        out = {"running": report.running, "finished_records": len(vtoken_stats(llm)["finished_requests"])}
        times: dict[str, list[float]] = {"vtoken_stats": [], "pool_report": []}
        for _ in range(args.calls):
            for name, fn in (("vtoken_stats", lambda: vtoken_stats(llm)), ("pool_report", lambda: pool_report(llm))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        enc, dec = MsgpackEncoder(), MsgpackDecoder()
        for name, fn in (("vtoken_stats", lambda: vtoken_stats(llm)), ("pool_report", lambda: pool_report(llm))):
            payload, wire = fn(), []
            for _ in range(args.calls):  # what the RPC adds: serialise in the EngineCore, parse in the replica
                t0 = time.perf_counter()
                frames = enc.encode(payload)
                dec.decode(frames)
                wire.append(time.perf_counter() - t0)
            out[name] = {
                **_summary(times[name]),
                "bytes": sum(len(b) for b in frames),
                "encode_decode": _summary(wire),
            }
        for rid in [f"run-{i}" for i in range(args.running)]:
            eng.abort_request([rid])
    return out


async def rpc(args, folder: str, cfg) -> dict:
    """AsyncLLM with its EngineCore in its own process, as in a replica, while the requests decode."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from vtoken.vllm_adapter import make_async_llm, pool_report_async, vtoken_stats_async

    llm = make_async_llm(folder, cfg, **engine_args(args))
    try:

        async def consume(i: int, prompt_tokens: int, max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            async for _ in llm.generate(TokensPrompt(prompt_token_ids=[7 + i % 90] * prompt_tokens), params, f"q{i}"):
                pass

        if args.finished:
            await asyncio.gather(*(consume(10_000 + i, 8, 4) for i in range(args.finished)))
        tasks = [asyncio.ensure_future(consume(i, args.prompt_tokens, args.max_tokens)) for i in range(args.running)]
        t_end = time.monotonic() + 300
        while (await pool_report_async(llm)).running < args.running:
            assert time.monotonic() < t_end, "requests did not all start"
            await asyncio.sleep(0.1)
        times: dict[str, list[float]] = {"vtoken_stats": [], "pool_report": []}
        calls = (("vtoken_stats", vtoken_stats_async), ("pool_report", pool_report_async))
        for _ in range(args.calls):
            for name, fn in calls:
                t0 = time.perf_counter()
                await fn(llm)
                times[name].append(time.perf_counter() - t0)
        running = (await pool_report_async(llm)).running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"running_at_end": running, **{k: _summary(v) for k, v in times.items()}}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--finished", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=800, help="long enough that no request ends while measured")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--skip-rpc", action="store_true")
    args = ap.parse_args()
    from vtoken.models import model_path
    from vtoken.vllm_adapter import VTokenConfig

    folder, cfg = str(model_path(args.model)), VTokenConfig(mode="vtoken", policy="h2o", budget=0.5, evict="always")
    load = os.getloadavg()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = {"model": args.model, "cpus": os.cpu_count(), "load_before": load, "direct": direct(args, folder, cfg)}
    if not args.skip_rpc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        result["rpc"] = asyncio.run(rpc(args, folder, cfg))
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
