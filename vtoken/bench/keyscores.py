"""Key-only scores (KNorm, KeyDiff) against the window's attention, for the decisions made before the question.

Issue 34 asks whether the chunk boundaries of a prompt (the decisions taken before the question is read) could be
scored from the keys alone, as KNorm and KeyDiff do, instead of from the attention of each chunk's last queries
(SnapKV's observation window, what the engine does). Measured before choosing, on the suites' own prompts:

  window   the attention each chunk's last ``--window`` queries give every key, accumulated (the engine's snapkv)
  knorm    minus the key's L2 norm, averaged over layers and KV heads (Devoto et al., 2024: keys of low norm draw
           attention); RoPE is a rotation, so the norm is the same before and after it
  keydiff  minus the cosine of the key with the mean direction of the live keys, per layer and KV head, averaged
           (Park et al., 2025: keep the keys least like the others)
  streaming  the newest tokens (no score at all): the floor a score has to beat

Every scorer goes through snapkv's pooling (``before``/``after``, sink and recent tokens kept), so only the statistic
differs. The decision with the question is the window's for every scorer: the prompt's last chunk is observed and
the request keeps its budget's target by that window, as the engine does at the first decode step; then greedy
decoding of ``--max-tokens`` (no further decision comes within a block of decoding).

The setting is ``evict: "always"`` without the parking tier: what a boundary drops is lost, so the boundary's
choice decides whether the answer survives. (With the tier, the last chunk attends the parked tokens and the
question chooses again among all of them; the boundary's statistic then matters only for what a full tier loses.)
It runs on plain transformers with the evicted tokens masked out, the construction of ``vtoken bench quality`` and
of the exactness tests' reference, so a score needs no engine support to be measured.

Cost, per chunk of ``c`` tokens over ``n`` keys: the window reads every live key once per observed query
(``W x n`` dot products a layer and head); a key score reads each new key once, when it is written (``c`` norms).
"""

from __future__ import annotations

import numpy as np

from vtoken.bench.engine_run import log
from vtoken.bench.needles import wilson
from vtoken.bench.quality import masked_forward
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET
from vtoken.core.budget import kept_tokens

SCORERS = ("window", "knorm", "keydiff", "streaming")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="niah", choices=("niah", "multi"), help="niah: the tuning suite; multi: held out")
    p.add_argument("--scorers", default=",".join(SCORERS))
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET)
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--depths", type=int, default=10)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--window", type=int, default=32, help="queries observed per chunk (the engine's prefill_window)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens decoded per prompt (0: the suite's default)")


def key_scores(keys: list, scorer: str, alive: np.ndarray) -> np.ndarray:
    """Higher means keep, for the ``alive`` token positions. ``keys``: one [kv_heads, tokens, head_size] tensor a
    layer (the cache's keys, dead tokens included)."""
    import torch

    k = torch.stack([layer[:, torch.as_tensor(alive)] for layer in keys]).float()  # [L, kvh, n, D]
    if scorer == "knorm":
        return (-k.norm(dim=-1).mean(dim=(0, 1))).numpy()
    unit = torch.nn.functional.normalize(k, dim=-1)
    anchor = torch.nn.functional.normalize(unit.mean(dim=2, keepdim=True), dim=-1)
    return (-(unit * anchor).sum(-1).mean(dim=(0, 1))).numpy()


def answer(model, prompt: list[int], scorer: str | None, policy, chunk: int, window: int, max_tokens: int) -> tuple:
    """Greedy reply token ids to ``prompt`` with boundaries scored by ``scorer`` (None: full KV), and the live
    tokens when the question had been read."""
    import torch

    from vtoken.core.policies import ATTN_SUM, PolicyInput

    n = len(prompt)
    ids = list(prompt)
    live = np.ones(n + max_tokens, dtype=bool)
    acc = np.zeros(n + max_tokens)
    cache = None

    def forward(start: int, end: int, observe: int):
        nonlocal cache
        out = masked_forward(model, ids, start, end, live, cache, observe > 0)
        cache = out.past_key_values
        if observe:  # dead keys get no attention (masked); each query's future is zero (causal)
            acc[:end] += sum(a[0, :, -observe:, :].sum(dim=(0, 1)) for a in out.attentions).float().numpy()
        return out.logits[0, -1]

    def decide(ctx: int, stat: np.ndarray) -> None:
        alive = np.flatnonzero(live[:ctx])
        keep = kept_tokens(ctx, policy.budget, policy.sink, policy.recent)
        victims = policy.select(PolicyInput(ctx, 0, alive, {ATTN_SUM: stat}), keep=keep)
        live[victims] = False

    with torch.no_grad():
        bounds = list(range(0, n, chunk)) + [n]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if start and scorer is not None:
                alive = np.flatnonzero(live[:start])
                if scorer == "window":
                    stat = acc[alive]
                elif scorer == "streaming":
                    stat = alive.astype(np.float64)
                else:
                    stat = key_scores([layer.keys[0] for layer in cache.layers], scorer, alive)
                decide(start, stat)
            observe = min(window, end - start) if scorer == "window" or (scorer and end == n) else 0
            if observe and scorer != "window":
                acc[:] = 0  # the question's window alone: earlier chunks were not observed
            logits = forward(start, end, observe)
        if scorer is not None:
            decide(n, acc[np.flatnonzero(live[:n])])
        held = int(live[:n].sum())
        out = []
        for t in range(max_tokens):
            out.append(int(logits.argmax()))
            if t == max_tokens - 1:
                break
            ids.append(out[-1])
            logits = forward(n + t, n + t + 1, 0)
    return out, held


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vtoken.bench.suites import SUITES, reply
    from vtoken.core.policies import make_policy
    from vtoken.models import model_path

    suite = SUITES[args.suite]
    if args.quick:
        model_name, lengths, depths, chunk, window, scorers = "tiny-llama", [96], 2, 32, 8, list(SCORERS)
        max_tokens = 4
    else:
        model_name, lengths, depths = args.model, [int(x) for x in args.lengths.split(",")], args.depths
        chunk, window, scorers = args.prefill_chunk, args.window, [s for s in args.scorers.split(",") if s]
        max_tokens = args.max_tokens or suite.max_tokens
    unknown = set(scorers) - set(SCORERS)
    if unknown:
        raise SystemExit(f"--scorers: unknown {sorted(unknown)}; known: {', '.join(SCORERS)}")
    model_dir = str(model_path(model_name))
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    cases = suite.build(tok, lengths, depths)
    policy = make_policy("snapkv", budget=args.budget)
    configs = {}
    for scorer in [None, *scorers]:
        label = scorer or "full KV"
        texts, hits, held = [], [], []
        for i, case in enumerate(cases):
            ids, live = answer(model, case.prompt, scorer, policy, chunk, window, max_tokens)
            texts.append(reply(tok, ids, suite.chat))
            hits.append(bool(suite.hit(case, texts[-1], None)))
            held.append(live / len(case.prompt))
            if (i + 1) % 10 == 0:
                log(f"[keyscores] {label}: {i + 1}/{len(cases)}, {sum(hits)} hits")
        lo, hi = wilson(sum(hits), len(hits))
        configs[label] = {"hits": sum(hits), "n": len(hits), "ci95": [lo, hi], "live_share": float(np.mean(held)),
                          "per_prompt": hits, "texts": texts}  # fmt: skip
        log(f"[keyscores] {label}: {sum(hits)}/{len(hits)}")
    return {
        "model": model_name,
        "suite": {"name": suite.name, "role": suite.role, "text": suite.text, "metric": suite.metric},
        "budget": args.budget,
        "prefill_chunk": chunk,
        "window": window,
        "max_tokens": max_tokens,
        "prompts": len(cases),
        "lengths": lengths,
        "configs": configs,
    }


def tables(result: dict) -> list[Table]:
    full = result["configs"]["full KV"]["hits"]
    rows = []
    for label, c in result["configs"].items():
        lo, hi = c["ci95"]
        share = f"{100 * c['hits'] / full:.0f}%" if full else "-"
        rows.append([label, f"{c['hits']}/{c['n']}", f"{100 * lo:.0f}-{100 * hi:.0f}%", share, c["live_share"]])
    return [
        Table(
            f"Scores for the decisions before the question: suite {result['suite']['name']} "
            f"({result['suite']['role']}), {result['model']}, snapkv pooling at {result['budget']:g}, chunks of "
            f"{result['prefill_chunk']}, no parking tier",
            ["boundary score", "hits", "95% interval", "of full KV", "live share after the question"],
            rows,
            f"Plain transformers, evicted tokens masked (vtoken/bench/keyscores.py). Every scorer's decision with the "
            f"question is the window of the last chunk's {result['window']} queries.",
        )
    ]


def plot(result: dict, fig) -> None:
    ax = fig.subplots()
    labels = list(result["configs"])
    c = [result["configs"][k] for k in labels]
    share = [x["hits"] / x["n"] for x in c]
    err = np.array([[s - x["ci95"][0], x["ci95"][1] - s] for s, x in zip(share, c)]).T
    ax.bar(labels, [100 * s for s in share], yerr=100 * err, capsize=4)
    ax.set(ylabel="hits (%)", title=f"{result['suite']['name']}: scores for the boundaries before the question")
