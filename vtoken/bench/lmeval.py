"""lm-evaluation-harness against stock `vllm serve` and `vtoken serve`: a loglikelihood task through
``local-completions`` (echo and prompt log-probabilities) and a generate-until task through
``local-chat-completions`` (the chat template), the same tasks and settings on every server.

  stock          stock vLLM's OpenAI server
  off            `vtoken serve`, vToken off: must score as stock does
  vtoken         `vtoken serve` with vToken's defaults (eviction under memory pressure only: on this light load
                 none comes, so it scores as off)
  vtoken-always  vToken evicting every request to its budget (``evict: always``, budget ``--budget``): what
                 eviction itself changes

The tasks (vtoken/bench/lmeval_tasks/) are 40 questions written for this benchmark, asked two ways; nothing was
tuned on them. lm-eval runs from a virtual environment of its own (``--lm-eval``: its ``lm_eval`` command;
``pip install "lm-eval[api]"``), since it pins packages vLLM pins otherwise. Accuracy with its 95% interval
(Wilson) over the 40 questions.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.needles import wilson
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET

TASKS = Path(__file__).resolve().parent / "lmeval_tasks"
SERVERS = ("stock", "off", "vtoken", "vtoken-always")
RUNS = {  # name -> (lm-eval model, task, route, extra lm_eval flags)
    "loglikelihood": ("local-completions", "vtoken_mc", "/v1/completions", []),
    "generate": ("local-chat-completions", "vtoken_gen", "/v1/chat/completions", ["--apply_chat_template"]),
}


def add_args(p) -> None:
    p.add_argument("--lm-eval", default="lm_eval", help="lm-eval's command, from a virtual environment of its own")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"any of {', '.join(SERVERS)}")
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET, help="vtoken-always's budget")
    p.add_argument("--kv-bytes", type=int, default=64 << 20)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--limit", type=int, default=0, help="questions per task (0: all 40)")


@contextlib.contextmanager
def _server(name: str, args):
    from vtoken.bench.serve import stock_server, vtoken_server
    from vtoken.models import model_path

    if name == "stock":
        with stock_server(args, str(model_path(args.model))) as url:
            yield url
        return
    on = {"mode": "vtoken"}
    vt = {"off": {"mode": "off"}, "vtoken": on, "vtoken-always": {**on, "evict": "always", "budget": args.budget}}[name]
    with vtoken_server(args, 1, vt) as url:
        yield url


def _lm_eval(args, url: str, run: str, out: Path) -> dict[str, Any]:
    from vtoken.models import model_path

    model, task, route, flags = RUNS[run]
    model_args = (f"model={args.model},base_url={url}{route},num_concurrent=1,max_retries=1,"
                  f"tokenizer={model_path(args.model)},tokenizer_backend=huggingface")  # fmt: skip
    if run == "generate":
        model_args += ",tokenized_requests=False"
    cmd = [args.lm_eval, "--model", model, "--model_args", model_args, "--tasks", task, "--include_path",
           str(TASKS), "--output_path", str(out), "--log_samples", "--batch_size", "1", *flags]  # fmt: skip
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    r = subprocess.run(cmd, cwd=TASKS, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"lm_eval failed ({run}): {r.stderr[-3000:]}")
    result = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    metrics = result["results"][task]
    key = "acc,none" if run == "loglikelihood" else "contains,none"
    samples = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime).read_text().splitlines()
    rows = [json.loads(s) for s in samples]
    rows.sort(key=lambda x: x["doc_id"])
    hits = [int(x[key.split(",")[0]]) for x in rows]
    # what the server answered: each choice's log-likelihood (loglikelihood), the generated text (generate)
    said = [[_first(c) for c in x["resps"]] if run == "loglikelihood" else [str(_leaf(x["resps"]))] for x in rows]
    return {"task": task, "metric": key, "score": metrics[key], "n": len(hits), "hits": sum(hits),
            "per_question": hits, "answers": said}  # fmt: skip


def _leaf(v: Any) -> Any:
    """The first leaf of lm-eval's nested responses (a choice's log-likelihood, a generated text)."""
    while isinstance(v, list | tuple) and v:
        v = v[0]
    return v


def _first(v: Any) -> Any:
    """``_leaf`` as a float where it is a number (lm-eval may write them as strings)."""
    v = _leaf(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= 1e-3 if isinstance(x, float) and isinstance(y, float) else x == y
        for x, y in zip(a, b, strict=True)
    )


def run(args) -> dict:
    import ray

    if args.quick:
        args.model, args.limit, args.servers = "tiny-llama", 4, "stock,off"
    servers = args.servers.split(",")
    started_ray = not ray.is_initialized()
    out: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in servers:
                log(f"[lmeval] {name}: starting")
                with _server(name, args) as url:
                    out[name] = {}
                    for run_name in RUNS:
                        log(f"[lmeval] {name}: {run_name}")
                        out[name][run_name] = r = _lm_eval(args, url, run_name, Path(tmp) / name / run_name)
                        log(f"[lmeval] {name} {run_name}: {r['hits']}/{r['n']}")
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()
    return {"model": args.model, "servers": servers, "budget": args.budget, "scores": out}


def tables(result: dict) -> list[Table]:
    rows = []
    scores = result["scores"]
    base = scores.get("stock")
    for name, runs in scores.items():
        for run_name, r in runs.items():
            lo, hi = wilson(r["hits"], r["n"])
            same = said = "-"
            if base is not None and name != "stock":
                b = base[run_name]
                same = f"{sum(x == y for x, y in zip(r['per_question'], b['per_question'], strict=False))}/{b['n']}"
                said = f"{sum(_same(x, y) for x, y in zip(r['answers'], b['answers'], strict=False))}/{b['n']}"
            rows.append([name, run_name, r["task"], f"{r['hits']}/{r['n']}", f"{r['score']:.3f}",
                         f"[{lo:.2f}, {hi:.2f}]", same, said])  # fmt: skip
    return [
        Table(
            f"lm-evaluation-harness on {result['model']}: local-completions (loglikelihood) and "
            "local-chat-completions (generate-until)",
            ["server", "run", "task", "hits", "score", "95% interval", "scored as stock", "answered as stock"],
            rows,
            f"vtoken-always: every request evicted to budget {result['budget']}. Scored as stock: questions with "
            "stock's hit or miss; answered as stock: the same generated text, or every choice's log-likelihood "
            "within 1e-3. The tasks: vtoken/bench/lmeval_tasks/ (40 questions, nothing tuned on them).",
        )
    ]
