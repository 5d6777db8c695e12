"""The held-out suite ``agree``: questions over a document, scored by agreement with full KV's own answers.

Not a needle: nothing is planted. Each prompt is a stretch of IDLE's release notes (``idle_text.release_notes``,
entries from a seed-chosen start, about the target length) and one question about a name that occurs exactly
once in it, in an entry at the prompt's depth (10%..90% of the document's tokens):
``What does the text say about "<name>"? Answer in one sentence.``, as one user turn through the chat template.

The metric, fixed before any eviction run was measured:
  - an answer is the greedy reply up to the end of the assistant's turn (at most ``max_tokens`` tokens);
  - its content words are its lower-cased words ([a-z0-9]+) less a fixed list of function words and less the
    question's own words (replies echo the question: "The text says that <name> ...");
  - ``agreement(answer, full)`` is the F1 of the two multisets of content words (SQuAD's token F1), 1 when both
    are empty;
  - a hit is agreement >= 0.5 with full KV's answer to the same prompt: at least half the substance shared.
Full KV scores 100% by definition. One token cannot flip it (a 10-word answer with one word changed keeps
F1 0.9), and a reworded answer that keeps the facts passes; an answer about another entry does not.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from vtoken.bench.idle_text import release_notes
from vtoken.bench.needles import Case

THRESHOLD = 0.5
INTRO = "Read the release notes below and answer the question."
QUESTION = 'What does the text say about "{name}"? Answer in one sentence.'
FUNCTION_WORDS = frozenset(
    "a an the and or but if then so of to in on at by for with from as into onto about over under than that this "
    "these those it its is are was were be been being has have had do does did not no can could will would shall "
    "should may might must which who whom whose what when where why how all any some such there here also only "
    "very more most other text says said".split()
)  # fmt: skip
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]")


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def agreement(answer: str, full: str, question: str = "") -> float:
    """Content-word F1 of ``answer`` against full KV's ``full`` (both already cut at the end of the turn)."""
    drop = FUNCTION_WORDS | set(words(question))
    a, f = (Counter(w for w in words(t) if w not in drop) for t in (answer, full))
    if not a or not f:
        return float(not a and not f)
    common = sum((a & f).values())
    if common == 0:
        return 0.0
    p, r = common / sum(a.values()), common / sum(f.values())
    return 2 * p * r / (p + r)


def agrees(answer: str, full: str, question: str = "") -> bool:
    return agreement(answer, full, question) >= THRESHOLD


def render(tok, document: str, name: str) -> str:
    user = f"{INTRO}\n\n{document}\n\nQuestion: {QUESTION.format(name=name)}"
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def bare_prompt(tok, case: Case) -> list[int]:
    """The same question without the document: a control for how much of an answer the document decides."""
    chat = [{"role": "user", "content": QUESTION.format(name=case.key)}]
    return encode(tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def build(tok, lengths=(1024, 2048), depths: int = 20, seed: int = 0, ask=None) -> list[Case]:
    """``depths`` prompts per length, the asked entry's depth spread evenly over 10%..90%. ``ask(tok, document,
    name)``: the prompt's text (default ``render``: the one-sentence question; the long-reply suite asks more)."""
    rng = np.random.default_rng(seed)
    entries = [e.strip() for e in release_notes().split("\n\n") if e.strip()]
    sizes = [len(encode(tok, e)) + 2 for e in entries]  # + the blank line
    out = []
    for length in lengths:
        for depth in np.linspace(0.1, 0.9, depths):
            start = (len(out) * 53) % len(entries)
            out.append(_case(tok, entries, sizes, rng, length, float(depth), start, ask or render))
    return out


def _case(tok, entries, sizes, rng, length: int, depth: float, start: int, ask=render) -> Case:
    room = length - len(encode(tok, ask(tok, "", "x" * 12)))
    doc, used, j = [], 0, start
    while used < room:  # whole entries from ``start`` (wrapping), the last one cut to fit
        entry, size = entries[j % len(entries)], sizes[j % len(entries)]
        if used + size > room:
            entry = tok.decode(encode(tok, entry)[: max(room - used - 2, 0)]).strip()
        doc.append(entry)
        used, j = used + size, j + 1
    cum = np.cumsum([0] + [len(encode(tok, e)) + 2 for e in doc])
    text = "\n\n".join(doc)
    counts = Counter(NAME.findall(text))
    at = int(np.searchsorted(cum, depth * cum[-1], side="right")) - 1
    for strict in (True, False):  # a name in the entry at the depth, else in its nearest; then any long word
        for k in sorted(range(len(doc)), key=lambda k: abs(k - at)):
            names = sorted({w for w in _names(doc[k], strict) if counts[w] == 1})
            if names:
                name = names[int(rng.integers(len(names)))]
                real = float((cum[k] + cum[k + 1]) / 2 / cum[-1])  # the asked entry's middle
                return Case("agree", length, real, name, "", encode(tok, ask(tok, text, name)))
    raise ValueError("no entry of this document has a name that occurs once")


def _names(entry: str, strict: bool) -> list[str]:
    """What a question may ask about. Strict: an identifier (``a.b``, ``a_b``, ``CamelCase``) or a capitalised
    word inside a sentence (a feature, a person); else any word of eight letters or more."""
    out = []
    for m in NAME.finditer(entry):
        w, before = m.group(), entry[: m.start()].rstrip()
        if not strict:
            ok = len(w) >= 8 and w.isalpha()
        elif "." in w or "_" in w:
            ok = w[-1] != "." and len(w) >= 4
        else:
            inner = w[0].isupper() and before and before[-1] not in ".:!?-" and w.lower() not in FUNCTION_WORDS
            ok = len(w) >= 4 and (any(c.isupper() for c in w[1:]) or inner)
        if ok:
            out.append(w)
    return out


def question(case: Case) -> str:
    return QUESTION.format(name=case.key)
