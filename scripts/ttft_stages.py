"""Where a streamed request's time to first token goes in `vtoken serve`'s gateway, under load: vLLM's benchmark
client (``--concurrency`` streams, random prompts) against one replica with vToken off (`vtoken bench serve`'s server
"off"), and per request, timed in the gateway's process:

  place_ms   the dispatcher took the rendered request (``Dispatcher.stream``) -> its replica was called
             (``Dispatcher._open``): placement
  first_ms   the replica was called -> its first chunk reached the dispatcher: the replica, its engine's queue and
             prefill, the token channel
  rest_ms    the client's TTFT median minus the two medians: the HTTP request, vLLM's serving layer (parsing,
             rendering, tokenizing) and the first chunk's way back to the client

Run from a tree's root with that tree's environment, so two doors can be compared (the dispatcher's ``stream`` and
``_open`` exist in both the hand-written door, 85e83a4, and vLLM's serving layer):

    cd <tree> && .venv/bin/python <this tree>/scripts/ttft_stages.py --concurrency 16 --prompts 256

A measurement, not a test: it depends on what else the machine runs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())  # the tree measured is the one this runs in, not the one this file is in


def instrument(dispatch) -> dict[str, dict[str, float]]:
    """Times each request's stages by wrapping the dispatcher's ``stream`` and ``_open``; request id -> stamps."""
    stamps: dict[str, dict[str, float]] = {}
    stream, open_ = dispatch.Dispatcher.stream, dispatch.Dispatcher._open

    async def timed_stream(self, req, door):
        r = stamps[req.request_id] = {"stream": time.monotonic()}
        async for d in stream(self, req, door):
            r.setdefault("first", time.monotonic())
            yield d

    def timed_open(self, name, replica, spec):
        stamps.setdefault(spec.request_id, {})["open"] = time.monotonic()
        return open_(self, name, replica, spec)

    dispatch.Dispatcher.stream, dispatch.Dispatcher._open = timed_stream, timed_open
    return stamps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the EngineCore in a process of its own, as deployed

    import cluster.serving.dispatch
    from vtoken.bench import serve
    from vtoken.models import model_path

    stamps = instrument(cluster.serving.dispatch)
    sp = argparse.ArgumentParser()
    serve.add_args(sp)
    a = sp.parse_args(["--model", args.model, "--input-len", str(args.input_len), "--output-len",
                       str(args.output_len), "--max-concurrency", str(args.concurrency)])  # fmt: skip
    folder = str(model_path(args.model))
    with serve.vtoken_server(a, 1, {"mode": "off"}) as url, tempfile.TemporaryDirectory() as tmp:
        serve.warm(a, url, folder, tmp)
        stamps.clear()
        r = serve.client(a, url, folder, float("inf"), tmp, num_prompts=args.prompts)
    timed = [s for s in stamps.values() if {"stream", "open", "first"} <= s.keys()]
    place = statistics.median(s["open"] - s["stream"] for s in timed) * 1e3
    first = statistics.median(s["first"] - s["open"] for s in timed) * 1e3
    out = {"tree": os.getcwd(), "concurrency": args.concurrency, "requests": len(timed),
           "ttft_median_ms": round(r["median_ttft_ms"], 1), "itl_median_ms": round(r["median_itl_ms"], 2),
           "place_ms": round(place, 2), "first_ms": round(first, 1),
           "rest_ms": round(r["median_ttft_ms"] - place - first, 1)}  # fmt: skip
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
