"""The held-out needle suite ``multi``: a second needle format, never used to choose a parameter.

What differs from the tuning suite (``needles.py``):

  text      the IDLE manual (``idle_text.manual()``), not the standard library's docstrings
  needles   three per prompt, one template ("The access code for <key> is: <value>."), with SIMILAR keys: the
            asked key ``a-n`` and two distractors that each share a word with it, ``b-n`` (another adjective)
            and ``a-m`` (another noun), so the model has to bind both words of the key
  question  before the text and again after it, in one user turn through the model's chat template
            (``apply_chat_template(..., tokenize=False)``, then encoded); the assistant's reply starts with
            the answer's first words, so its next tokens are the value

A depth is where the asked needle sits, as a share of the text's tokens (10%..90%); the distractors sit at
depths drawn from the seed, at least 10% away from it and from each other. A hit is the value among the first
two numbers of the reply, cut at the end of the assistant's turn (``needles.hit``).
"""

from __future__ import annotations

import functools

import numpy as np

from vtoken.bench.idle_text import manual
from vtoken.bench.needles import Case

ADJECTIVES = (
    "silver", "golden", "copper", "scarlet", "violet", "marble", "velvet", "frozen", "hidden", "northern",
    "southern", "crystal", "ancient", "gentle", "hollow", "rapid",
)  # fmt: skip
NOUNS = (
    "falcon", "kettle", "lantern", "harbor", "meadow", "badger", "anchor", "orchard", "compass", "violin",
    "tunnel", "saddle", "pepper", "walnut", "garden", "island",
)  # fmt: skip
INTRO = "Some access codes are hidden in the text below. Read it and answer the question."
NEEDLE = "The access code for {key} is: {value}."
QUESTION = "What is the access code for {key}?"
REPLY = "The access code for {key} is:"  # the assistant's reply starts so; its next tokens are the value


def keys(rng) -> tuple[str, str, str]:
    """The asked key and its two look-alikes, each sharing one word with it."""
    a, b = rng.choice(ADJECTIVES, 2, replace=False)
    n, m = rng.choice(NOUNS, 2, replace=False)
    return f"{a}-{n}", f"{b}-{n}", f"{a}-{m}"


def render(tok, key: str, lines: list[str]) -> str:
    """The whole prompt as text: one user turn (question, text, question), then the reply's first words."""
    q = QUESTION.format(key=key)
    user = f"{INTRO}\n\nQuestion: {q}\n\nText:\n" + "\n".join(lines) + f"\n\nQuestion: {q} Answer with the code only."
    chat = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return chat + REPLY.format(key=key)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]  # the template wrote its own special tokens


def build(tok, lengths=(1024, 2048), depths: int = 20, seed: int = 0) -> list[Case]:
    """``depths`` prompts per length, the asked needle's depth spread evenly over 10%..90%."""
    rng = np.random.default_rng(seed)
    lines = manual().splitlines()
    sizes = [len(encode(tok, line)) + 1 for line in lines]  # + the newline
    out = []
    for length in lengths:
        for depth in np.linspace(0.1, 0.9, depths):
            start = (len(out) * 37) % len(lines)
            out.append(_case(tok, lines, sizes, rng, length, float(depth), start))
    return out


def _case(tok, lines, sizes, rng, length: int, depth: float, start: int) -> Case:
    ks = keys(rng)
    values = [str(rng.integers(1_000_000, 10_000_000)) for _ in ks]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(ks, values)]
    room = length - len(encode(tok, render(tok, ks[0], needles)))
    hay, used, j = [], 0, start
    while used < room:  # whole lines of the manual from ``start`` (wrapping), the last one cut to fit
        line, size = lines[j % len(lines)], sizes[j % len(lines)]
        if used + size > room:
            line = tok.decode(encode(tok, line)[: room - used - 1]).strip()
        hay.append(line)
        used, j = used + size, j + 1
    cum = np.cumsum([0] + [len(encode(tok, line)) + 1 for line in hay])
    spots = [depth]
    while len(spots) < len(ks):  # the distractors' depths: away from the asked needle and from each other
        d = float(rng.uniform(0.05, 0.95))
        if all(abs(d - s) >= 0.1 for s in spots):
            spots.append(d)
    at = [int(np.searchsorted(cum, s * cum[-1])) for s in spots]
    body = list(hay)
    for k in sorted(range(len(ks)), key=lambda k: -at[k]):  # from the back, so earlier indices stay valid
        body.insert(at[k], needles[k])
    real = float(cum[min(at[0], len(hay))] / cum[-1])  # the asked needle's depth as placed (a line boundary)
    return Case("multi", length, real, ks[0], values[0], encode(tok, render(tok, ks[0], body)))


@functools.cache
def describe() -> str:
    return (
        "3 needles with look-alike keys (a-n asked; b-n and a-m distractors), question before and after the text, "
        "chat template; haystack: the IDLE manual"
    )
