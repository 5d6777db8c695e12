"""The held-out suite ``longreply``: long replies over a document, scored against full KV's own reply.

Users say compression breaks in long answers: a 256-token reply needs different parts of the document at
different tokens, long after the question was read. The prompts are ``agree``'s documents (IDLE's release notes,
the same builder, so the same lengths and depths), with a request for a long answer in place of the one-sentence
question: ``Starting with the entry that mentions "<name>", retell that entry and the entries after it, one by
one, in detail.``, through the chat template.

The metrics, fixed before any eviction run was measured:
  - ``agreement(answer, full)``: ``agree``'s content-word F1 of the reply against full KV's reply to the same prompt
    (the question's own words and function words left out), a hit at >= 0.5;
  - ``parted_at``: the first word (lower-cased [a-z0-9]+) at which the reply and full KV's differ, the reply's
    length in words when one is the other's beginning: how long it followed full KV word for word.
"""

from __future__ import annotations

from vtoken.bench import agree
from vtoken.bench.needles import Case

THRESHOLD = agree.THRESHOLD
INTRO = "Read the release notes below and answer the request."
REQUEST = (
    'Starting with the entry that mentions "{name}", retell that entry and the entries after it, one by one, in detail.'  # noqa: E501
)


def render(tok, document: str, name: str) -> str:
    user = f"{INTRO}\n\n{document}\n\nRequest: {REQUEST.format(name=name)}"
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def build(tok, lengths=(1024, 2048), depths: int = 10, seed: int = 0) -> list[Case]:
    return [c._replace(task="longreply") for c in agree.build(tok, lengths, depths, seed, ask=render)]


def question(case: Case) -> str:
    return REQUEST.format(name=case.key)


def parted_at(answer: str, full: str) -> int:
    """The first word at which ``answer`` and ``full`` differ (both lower-cased words)."""
    a, f = agree.words(answer), agree.words(full)
    for i, (x, y) in enumerate(zip(a, f)):
        if x != y:
            return i
    return min(len(a), len(f))


def hit(case: Case, reply: str, full: str) -> bool:
    return agree.agreement(reply, full, question(case)) >= THRESHOLD
