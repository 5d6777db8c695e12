"""What each policy and budget costs in output quality, against full KV, on SmolLM2.

1. Perplexity on real text the machine ships (CPython's reference pages, ``pydoc_data``; never model
   output): a context of ``--context`` tokens, then ``--eval-tokens`` tokens teacher-forced one at a time
   while the policy evicts, exactly as vToken's scheduler would (same policy classes and budgets; h2o and
   scissorhands fed the attention each step produced). It runs on plain transformers with the evicted
   tokens masked out - the same construction as the exactness tests' reference, which vToken matches to
   2e-6 in log-probability - because vLLM cannot teacher-force decode steps.
2. Passkey retrieval through vLLM, off / naive / vtoken side by side: a 5-digit key hidden at several
   depths of real text, then "What is the pass key? The pass key is"; a hit is the exact key in the answer.
   Eviction starts at the first decode step, so the key's digits are produced from the evicted KV.
naive and vtoken make the same decisions, so their outputs must be identical; the naive engine serves
every request, in the same batches as the vtoken engine, to show it.

Each policy and budget runs twice: with eviction between prefill chunks (``prefill_evict``, the default:
the context or prompt is read in chunks of ``--prefill-chunk`` tokens and the policy evicts after each,
h2o and scissorhands scoring the chunk's last ``--window`` queries) and with eviction only once it is read
(decode-only). Compressing a prompt while it is read is known to cost exact retrieval; this is the figure
users choose the default by.
"""

from __future__ import annotations

import numpy as np

from vtoken.bench.engine_run import Engine, log
from vtoken.bench.report import Table
from vtoken.core.budget import kept_tokens
from vtoken.kv.query_window import DECODE_WINDOW

POLICIES = ("h2o", "scissorhands", "random", "streaming")
ATTENTION_POLICIES = ("h2o", "scissorhands")  # the ones score_every applies to


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--budgets", default="0.5,0.25,0.125")
    p.add_argument("--context", type=int, default=512, help="perplexity: tokens before the evaluated ones")
    p.add_argument("--eval-tokens", type=int, default=128, help="perplexity: teacher-forced tokens")
    p.add_argument("--passages", type=int, default=1)
    p.add_argument("--haystack", type=int, default=400, help="passkey: tokens of text around the key")
    p.add_argument("--keys", type=int, default=6, help="passkey prompts (depths spread over the text)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="tokens per prefill chunk (both parts)")
    p.add_argument("--window", type=int, default=32, help="h2o/scissorhands: queries scored per prefill chunk")
    p.add_argument(
        "--score-every",
        default="4",
        help="h2o/scissorhands also with score_every=k for each k listed (opt-in: one decode step in k observed); "
        "empty for none",
    )


# ---------------------------------------------------------------------------------------- perplexity
def masked_forward(model, ids: list[int], start: int, end: int, live: np.ndarray, cache, attentions: bool):
    """A plain transformers forward of ``ids[start:end]`` over the tokens ``live`` marks (evicted keys masked out,
    positions unchanged): the construction of the exactness tests' reference. ``cache``: the previous forward's."""
    import torch

    return model(
        input_ids=torch.tensor([ids[start:end]]),
        position_ids=torch.arange(start, end)[None],
        attention_mask=torch.tensor(live[:end][None].astype(np.int64)),
        past_key_values=cache,
        use_cache=True,
        output_attentions=attentions,
    )


def perplexity(model, ids: list[int], ctx: int, policy, chunk: int = 0, window: int = 32) -> float:
    """Mean NLL of ids[ctx:] teacher-forced one at a time after ids[:ctx]. ``chunk`` > 0: the context is read
    in chunks and the policy evicts after each (prefill eviction), scoring each chunk's last ``window``
    queries; 0: the context is read at once and eviction starts with the decode steps."""
    import torch

    from vtoken.core.policies import ATTN_HIST, ATTN_SUM, PolicyInput
    from vtoken.core.schedule import Schedule
    from vtoken.kv.scores import uniform_share

    t_eval = len(ids) - ctx
    live = np.ones(len(ids), dtype=bool)
    acc = np.zeros(len(ids))
    hist = np.zeros(len(ids), dtype=np.int64)
    needs = bool(policy and policy.needs)
    have = False  # statistics from the forward just run, as the engine's scheduler receives them
    # The engine's own timing rules (vtoken/core/schedule.py): when the policy may evict, which queries are scored.
    sched = Schedule.of(policy, prefill_evict=bool(chunk), window=window, block_size=32) if policy else None
    recent: list[
        np.ndarray
    ] = []  # on-demand policies: the attention rows of the decode queries since the last decision

    def keep(n: int) -> int:
        return kept_tokens(n, policy.budget, policy.sink, policy.recent)  # the engine's rule (vtoken/core/budget.py)

    def evict(n: int, num_output: int) -> None:
        nonlocal have
        if policy is None or (policy.needs and not have):
            return
        step = sched.decision_step(n, ctx, num_output, int(live[:n].sum()) - keep(n))
        if step is None:
            return
        alive = np.flatnonzero(live[:n])
        if sched.on_demand and step:  # the window of recent queries, scored at the decision (vtoken/kv/query_window.py)
            acc[:] = 0
            for row in recent:
                acc[: row.size] += row
            recent.clear()
        stats = {ATTN_SUM: acc[alive], ATTN_HIST: hist[alive]}
        victims = policy.select(PolicyInput(n, step, alive, {k: stats[k] for k in policy.needs}, None, 7))
        live[victims] = False

    def forward(start: int, end: int, cache, observe: int):
        """Tokens [start, end) over the live keys; scores the last ``observe`` queries."""
        nonlocal have
        out = masked_forward(model, ids, start, end, live, cache, needs and observe > 0)
        have = needs and observe > 0
        if have:
            layers, heads = len(out.attentions), out.attentions[0].shape[1]
            for q in range(end - observe, end):  # in order, as the scorer folds them
                w = sum(a[0, :, q - start, :].sum(0) for a in out.attentions).float().numpy()[: q + 1]
                if sched.on_demand and end - start == 1:  # a decode query: into the window, scored at a decision
                    recent[:] = [*recent[-(DECODE_WINDOW - 1) :], w]
                    continue
                acc[: q + 1] += w
                # The scorer's one definition (vtoken.kv.scores.uniform_share): 1 / the keys this query attends
                # to, itself included. Here those are the live tokens up to it (the mask hides the dead),
                # which is what the engine's physical causal length p_q + 1 counts once dead slots are packed.
                hot = (w / (layers * heads) > uniform_share(live[: q + 1].sum())).astype(np.int64)
                hist[: q + 1] = (hist[: q + 1] << 1) | hot
        return out

    with torch.no_grad():
        cache = None
        bounds = list(range(0, ctx, chunk)) + [ctx] if chunk else [0, ctx]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if start:
                evict(start, 0)  # a chunk boundary
            over = policy is not None and live[:end].sum() > policy.target(end)
            out = forward(start, end, cache, sched.chunk_queries(end - start, end, ctx, over) if sched else 0)
            cache = out.past_key_values
        logits, n, nll = out.logits[0, -1], ctx, []
        for t in range(t_eval):
            nll.append(float(-torch.log_softmax(logits.float(), -1)[ids[ctx + t]]))
            if t == t_eval - 1:
                break
            evict(n, t + 1)  # t + 1 outputs sampled (the boundary after the last chunk at the first)
            # This forward completes decode step t + 2; observed one step in score_every (full KV: always); on-demand
            # policies keep every decode query in their window.
            observe = sched is None or sched.on_demand or sched.decode_ask(t + 2, True)[0]
            out = forward(n, n + 1, cache, int(observe))
            cache, logits, n = out.past_key_values, out.logits[0, -1], n + 1
    return float(np.mean(nll))


def _perplexities(model_dir: str, configs, ctx: int, t_eval: int, passages: int, chunk: int, window: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vtoken.texts import python_docs
    from vtoken.vllm_adapter import VTokenConfig

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(python_docs()[:400_000])["input_ids"]
    stride = (len(ids) - ctx - t_eval) // max(passages, 1)
    docs = [ids[i * stride : i * stride + ctx + t_eval] for i in range(passages)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = {}
    for label, (policy, budget, prefill, every) in configs.items():
        params = {"score_every": every} if every > 1 else {}
        pol = VTokenConfig(policy=policy, budget=budget, policy_params=params).make_policy() if policy else None
        nll = float(np.mean([perplexity(model, d, ctx, pol, chunk if prefill else 0, window) for d in docs]))
        out[label] = {
            "policy": policy or "full KV",
            "budget": budget,
            "prefill_evict": prefill,
            "score_every": every,
            "nll": nll,
            "perplexity": float(np.exp(nll)),
        }
        log(f"[perplexity] {label}: {np.exp(nll):.2f}")
    return out


# ---------------------------------------------------------------------------------------- passkey
def passkey_prompts(model_dir: str, n: int, haystack: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    from transformers import AutoTokenizer

    from vtoken.texts import python_docs

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok(python_docs()[400_000:])["input_ids"]
    rng = np.random.default_rng(seed)
    prompts, keys = [], []
    for i in range(n):
        key = str(rng.integers(10000, 99999))
        depth = (i + 0.5) / n
        hay = text[i * haystack : (i + 1) * haystack]
        cut = int(depth * len(hay))
        needle = tok(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")["input_ids"]
        question = tok("\nWhat is the pass key? The pass key is")["input_ids"]
        prompts.append(hay[:cut] + needle + hay[cut:] + question)
        keys.append(key)
    return prompts, keys


def _passkey(model_dir: str, configs, n_keys: int, haystack: int, chunk: int, window: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, keys = passkey_prompts(model_dir, n_keys, haystack)
    # At most 32 requests at once, so that the pool never binds (SmolLM2: 730 blocks, a request at most 15): the
    # naive and vtoken engines then admit and batch the requests alike, and their answers can be compared.
    kw = dict(kv_bytes=1 << 30, max_model_len=haystack + 128, max_num_seqs=32, enable_prefix_caching=False)
    evicting = {k: v for k, v in configs.items() if v[0]}
    out = {}
    with Engine(model_dir, "off", {"prefill_chunk": chunk}, **kw) as e:
        b = e.batch(prompts, 8)
        out["off"] = [tok.decode(s.output_tokens) for s in b.served]
    for mode in ("naive", "vtoken"):
        # Both engines serve every request in the same batches: outputs depend on the batch a request shares
        # a forward with (float rounding in batched kernels), so only the same batches can show identical answers.
        # (Under KV pressure vtoken admits requests earlier than naive, which changes the batches.)
        reqs = [(label, i) for label in evicting for i in range(n_keys)]
        cfg = {"policy": "h2o", "collect_scores": True, "prefill_chunk": chunk, "prefill_window": window}
        with Engine(model_dir, mode, cfg, **kw) as e:
            b = e.batch(
                [prompts[i] for _, i in reqs],
                8,
                [_request_options(*evicting[label]) for label, _ in reqs],
            )
        for (label, i), s in zip(reqs, b.served):
            out.setdefault(f"{mode}:{label}", [None] * n_keys)[i] = tok.decode(s.output_tokens)
    hits = {k: sum(key in text for key, text in zip(keys, v)) / n_keys for k, v in out.items()}
    same = all(out[f"naive:{k}"] == out[f"vtoken:{k}"] for k in evicting if f"naive:{k}" in out)
    return {"keys": keys, "answers": out, "accuracy": hits, "naive_equals_vtoken": same}


def _label(policy: str, budget: float, every: int, prefill: bool) -> str:
    """A configuration's key in the results: "h2o@0.25", "h2o@0.25 every 4 decode-only", ..."""
    return f"{policy}@{budget:g}" + (f" every {every}" if every > 1 else "") + ("" if prefill else " decode-only")


def _request_options(policy: str, budget: float, prefill: bool, every: int) -> dict:
    opts = {"policy": policy, "budget": budget, "prefill_evict": prefill}
    return {**opts, "policy_params": {"score_every": every}} if every > 1 else opts


def run(args) -> dict:
    from vtoken.models import model_path

    if args.quick:
        model, policies, budgets, ctx, t_eval, passages, n_keys, hay = (
            "tiny-llama",
            ["h2o", "random"],
            [0.25],
            64,
            16,
            1,
            2,
            96,
        )
    else:
        model, policies, budgets = args.model, args.policies.split(","), [float(b) for b in args.budgets.split(",")]
        ctx, t_eval, passages, n_keys, hay = args.context, args.eval_tokens, args.passages, args.keys, args.haystack
    model_dir = str(model_path(model))
    chunk, window = (32, 8) if args.quick else (args.prefill_chunk, args.window)
    every = [2] if args.quick else [int(k) for k in args.score_every.split(",") if k.strip()]
    if any(k < 2 for k in every):
        raise SystemExit(f"--score-every: each k must be >= 2 (1 is the exact default), got {args.score_every}")
    configs = {"full": (None, 1.0, False, 1)}
    for p in policies:
        for b in budgets:
            for k in [1] + (every if p in ATTENTION_POLICIES else []):
                for prefill in (True, False):
                    configs[_label(p, b, k, prefill)] = (p, b, prefill, k)
    ppl = _perplexities(model_dir, configs, ctx, t_eval, passages, chunk, window)
    pk = _passkey(model_dir, configs, n_keys, hay, chunk, window)
    log(f"[passkey] accuracy: {pk['accuracy']}")
    return {
        "model": model,
        "policies": policies,
        "budgets": budgets,
        "context": ctx,
        "eval_tokens": t_eval,
        "passages": passages,
        "haystack": hay,
        "prefill_chunk": chunk,
        "window": window,
        "score_every": every,
        "perplexity": ppl,
        "passkey": pk,
    }


def _row(result: dict, p: str, b: float, k: int, base: float) -> list:
    on, off = _label(p, b, k, True), _label(p, b, k, False)
    ppl, acc = result["perplexity"], result["passkey"]["accuracy"]
    return [
        p if k == 1 else f"{p}, score_every {k}",
        b,
        round(ppl[on]["perplexity"], 2),
        f"{100 * (ppl[on]['perplexity'] / base - 1):+.1f}%",
        round(ppl[off]["perplexity"], 2),
        f"{100 * (ppl[off]['perplexity'] / base - 1):+.1f}%",
        f"{100 * acc.get('vtoken:' + on, float('nan')):.0f}%",
        f"{100 * acc.get('vtoken:' + off, float('nan')):.0f}%",
    ]


def tables(result: dict) -> list[Table]:
    base = result["perplexity"]["full"]["perplexity"]
    acc = result["passkey"]["accuracy"]
    rows = [["full KV (off)", "-", round(base, 2), "-", "-", "-", f"{100 * acc['off']:.0f}%", "-"]]
    for p in result["policies"]:
        for b in result["budgets"]:
            for k in [1] + (result.get("score_every", []) if p in ATTENTION_POLICIES else []):
                rows.append(_row(result, p, b, k, base))
    return [
        Table(
            f"Output quality against full KV ({result['model']}): perplexity over {result['passages']} x "
            f"{result['eval_tokens']} tokens after {result['context']} tokens of CPython's reference text; "
            f"passkey retrieval in {result['haystack']} tokens of text, {len(result['passkey']['keys'])} keys; "
            f"prompts read in chunks of {result.get('prefill_chunk')} tokens",
            [
                "policy",
                "budget",
                "perplexity, prefill eviction",
                "vs full KV",
                "perplexity, decode-only",
                "vs full KV",
                "passkey hits, prefill eviction",
                "passkey hits, decode-only",
            ],
            rows,
            f"Prefill eviction: the policy also evicts between prefill chunks (h2o and scissorhands score each "
            f"chunk's last {result.get('window')} queries). naive and vtoken answers identical: "
            f"{result['passkey']['naive_equals_vtoken']}.",
        )
    ]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    base = result["perplexity"]["full"]["perplexity"]
    acc = result["passkey"]["accuracy"]
    bs = result["budgets"]
    for i, p in enumerate(result["policies"]):
        c = f"C{i}"
        for suffix, ls in (("", "o-"), (" decode-only", "s--")):
            label = p + (" (decode-only)" if suffix else " (prefill eviction)")
            ax1.plot(bs, [result["perplexity"][f"{p}@{b:g}{suffix}"]["perplexity"] for b in bs], ls, c=c, label=label)
            ax2.plot(bs, [100 * acc[f"vtoken:{p}@{b:g}{suffix}"] for b in bs], ls, c=c, label=label)
    ax1.axhline(base, color="k", ls=":", label="full KV")
    ax2.axhline(100 * acc["off"], color="k", ls=":", label="full KV")
    for ax, yl in ((ax1, "perplexity"), (ax2, "passkey hits (%)")):
        ax.set(xlabel="budget (live ratio)", ylabel=yl, xscale="log")
        ax.legend(fontsize=6)
