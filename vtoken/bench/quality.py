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
the h2o requests to show it.
"""

from __future__ import annotations

import numpy as np

from vtoken.bench.engine_run import Engine, log
from vtoken.bench.report import Table

POLICIES = ("h2o", "scissorhands", "random", "streaming")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--budgets", default="0.5,0.25,0.125")
    p.add_argument("--context", type=int, default=512, help="perplexity: tokens before the evaluated ones")
    p.add_argument("--eval-tokens", type=int, default=128, help="perplexity: teacher-forced tokens")
    p.add_argument("--passages", type=int, default=1)
    p.add_argument("--haystack", type=int, default=400, help="passkey: tokens of text around the key")
    p.add_argument("--keys", type=int, default=6, help="passkey prompts (depths spread over the text)")


# ---------------------------------------------------------------------------------------- perplexity
def _stats(attn) -> np.ndarray:
    """Attention each key received this step, summed over layers and heads (what the scorer sums)."""
    return sum(a[0, :, -1, :].sum(0) for a in attn).float().numpy()


def perplexity(model, ids: list[int], ctx: int, policy) -> float:
    import torch

    from vtoken.policies import ATTN_HIST, ATTN_SUM, PolicyInput
    from vtoken.scores import uniform_share

    t_eval = len(ids) - ctx
    live = np.ones(len(ids), dtype=bool)
    acc = np.zeros(len(ids))
    hist = np.zeros(len(ids), dtype=np.int64)
    nll = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[:ctx]]), use_cache=True)
        cache, logits, n, decoded = out.past_key_values, out.logits[0, -1], ctx, 0
        for t in range(t_eval):
            nll.append(float(-torch.log_softmax(logits.float(), -1)[ids[ctx + t]]))
            if t == t_eval - 1:
                break
            if policy is not None and (decoded or not policy.needs):
                alive = np.flatnonzero(live[:n])
                stats = {ATTN_SUM: acc[alive], ATTN_HIST: hist[alive]}
                victims = policy.select(PolicyInput(n, t + 1, alive, {k: stats[k] for k in policy.needs}, None, 7))
                live[victims] = False
            mask = torch.tensor(live[: n + 1][None].astype(np.int64))
            out = model(
                input_ids=torch.tensor([[ids[n]]]),
                position_ids=torch.tensor([[n]]),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                output_attentions=bool(policy and policy.needs),
            )
            if policy is not None and policy.needs:
                w = _stats(out.attentions)
                acc[: n + 1] += w
                share = w / (len(out.attentions) * out.attentions[0].shape[1])
                # The scorer's one definition (vtoken.scores.uniform_share): 1 / the keys this query attends
                # to, itself included. Here those are the live tokens up to it (the mask hides the dead),
                # which is what the engine's physical causal length p_q + 1 counts once dead slots are packed.
                hot = (share > uniform_share(live[: n + 1].sum())).astype(np.int64)
                hist[: n + 1] = (hist[: n + 1] << 1) | hot
            cache, logits, n, decoded = out.past_key_values, out.logits[0, -1], n + 1, decoded + 1
    return float(np.mean(nll))


def _perplexities(model_dir: str, configs, ctx: int, t_eval: int, passages: int) -> dict:
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
    for label, (policy, budget) in configs.items():
        pol = VTokenConfig(policy=policy, budget=budget).make_policy() if policy else None
        nll = float(np.mean([perplexity(model, d, ctx, pol) for d in docs]))
        out[label] = {"policy": policy or "full KV", "budget": budget, "nll": nll, "perplexity": float(np.exp(nll))}
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


def _passkey(model_dir: str, configs, n_keys: int, haystack: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, keys = passkey_prompts(model_dir, n_keys, haystack)
    kw = dict(kv_bytes=1 << 30, max_model_len=haystack + 128, max_num_seqs=32, enable_prefix_caching=False)
    evicting = {k: v for k, v in configs.items() if v[0]}
    out = {}
    with Engine(model_dir, "off", **kw) as e:
        b = e.batch(prompts, 8)
        out["off"] = [tok.decode(s.output_tokens) for s in b.served]
    for mode in ("naive", "vtoken"):
        chosen = {k: v for k, v in evicting.items() if mode == "vtoken" or v[0] == "h2o"}
        reqs = [(label, i) for label in chosen for i in range(n_keys)]
        with Engine(model_dir, mode, {"policy": "h2o", "collect_scores": True}, **kw) as e:
            b = e.batch(
                [prompts[i] for _, i in reqs],
                8,
                [{"policy": chosen[label][0], "budget": chosen[label][1]} for label, _ in reqs],
            )
        for (label, i), s in zip(reqs, b.served):
            out.setdefault(f"{mode}:{label}", [None] * n_keys)[i] = tok.decode(s.output_tokens)
    hits = {k: sum(key in text for key, text in zip(keys, v)) / n_keys for k, v in out.items()}
    same = all(out[f"naive:{k}"] == out[f"vtoken:{k}"] for k in evicting if f"naive:{k}" in out)
    return {"keys": keys, "answers": out, "accuracy": hits, "naive_equals_vtoken": same}


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
    configs = {"full": (None, 1.0), **{f"{p}@{b:g}": (p, b) for p in policies for b in budgets}}
    ppl = _perplexities(model_dir, configs, ctx, t_eval, passages)
    pk = _passkey(model_dir, configs, n_keys, hay)
    log(f"[passkey] accuracy: {pk['accuracy']}")
    return {
        "model": model,
        "policies": policies,
        "budgets": budgets,
        "context": ctx,
        "eval_tokens": t_eval,
        "passages": passages,
        "haystack": hay,
        "perplexity": ppl,
        "passkey": pk,
    }


def tables(result: dict) -> list[Table]:
    base = result["perplexity"]["full"]["perplexity"]
    acc = result["passkey"]["accuracy"]
    rows = [["full KV (off)", "-", round(base, 2), "-", f"{100 * acc['off']:.0f}%"]]
    for label, r in result["perplexity"].items():
        if label == "full":
            continue
        rows.append(
            [
                r["policy"],
                r["budget"],
                round(r["perplexity"], 2),
                f"{100 * (r['perplexity'] / base - 1):+.1f}%",
                f"{100 * acc.get('vtoken:' + label, float('nan')):.0f}%",
            ]
        )
    return [
        Table(
            f"Output quality against full KV ({result['model']}): perplexity over {result['passages']} x "
            f"{result['eval_tokens']} tokens after {result['context']} tokens of CPython's reference text; "
            f"passkey retrieval in {result['haystack']} tokens of text, {len(result['passkey']['keys'])} keys",
            ["policy", "budget", "perplexity", "vs full KV", "passkey hits (vtoken)"],
            rows,
            f"naive and vtoken answers identical: {result['passkey']['naive_equals_vtoken']}.",
        )
    ]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    base = result["perplexity"]["full"]["perplexity"]
    acc = result["passkey"]["accuracy"]
    for p in result["policies"]:
        bs = result["budgets"]
        ax1.plot(bs, [result["perplexity"][f"{p}@{b:g}"]["perplexity"] for b in bs], "o-", label=p)
        ax2.plot(bs, [100 * acc[f"vtoken:{p}@{b:g}"] for b in bs], "o-", label=p)
    ax1.axhline(base, color="k", ls="--", label="full KV")
    ax2.axhline(100 * acc["off"], color="k", ls="--", label="full KV")
    for ax, yl in ((ax1, "perplexity"), (ax2, "passkey hits (%)")):
        ax.set(xlabel="budget (live ratio)", ylabel=yl, xscale="log")
        ax.legend(fontsize=8)
