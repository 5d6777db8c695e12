"""The suites ``vtoken bench retrieval --suite`` serves, by name: one to tune on, three held out.

Every parameter of eviction (the pooling window, the prefill window, the watermark, the tier's size, the
default mode, recall's cadence) is chosen on ``niah`` alone; ``multi``, ``agree`` and ``longreply`` only report.
A suite builds its prompts (``needles.Case``, token ids of the model's tokenizer) and says whether a reply counts;
``agree`` and ``longreply`` count a reply by full KV's reply to the same prompt, so they need full KV in the same
run (or its replies from an earlier one, ``--reference``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from vtoken.bench import agree, longreply, multi, needles
from vtoken.bench.needles import Case


class Suite(NamedTuple):
    name: str
    tuning: bool  # parameters were (and will be) chosen on it
    text: str  # where its prompts come from
    metric: str
    build: Callable[..., list[Case]]  # (tok, lengths, depths, seed) -> cases
    hit: Callable[[Case, str, str], bool]  # (case, reply, full KV's reply) -> counts
    chat: bool  # prompts go through the chat template: a reply ends at the end of the assistant's turn
    lengths: str  # defaults of --lengths, --depths, --max-tokens
    depths: int
    max_tokens: int
    needs_full: bool = False  # the metric is relative to full KV's replies

    @property
    def role(self) -> str:
        return "tuning suite" if self.tuning else "held out (never tuned on)"


SUITES = {
    "niah": Suite(
        "niah", True, "the standard library's docstrings",
        "the needle's 7-digit value among the first two numbers of the reply",
        needles.build, lambda c, reply, full: needles.hit(c.answer, reply), False, "1024,2048,4096", 12, 12,
    ),
    "multi": Suite(
        "multi", False, "the IDLE manual (CPython's idlelib/help.html)",
        "the asked needle's 7-digit value among the first two numbers of the reply (3 look-alike keys)",
        multi.build, lambda c, reply, full: needles.hit(c.answer, reply), True, "1024,2048", 20, 16,
    ),
    "agree": Suite(
        "agree", False, "IDLE's release notes (CPython's idlelib/NEWS*.txt, HISTORY.txt)",
        f"content-word F1 with full KV's reply to the same question >= {agree.THRESHOLD}",
        agree.build, lambda c, reply, full: agree.agrees(reply, full, agree.question(c)), True, "1024,2048", 20,
        32, needs_full=True,
    ),
    "longreply": Suite(
        "longreply", False, "IDLE's release notes (as agree), a long answer asked",
        f"content-word F1 with full KV's 256-token reply >= {longreply.THRESHOLD}; and the first word where they part",
        longreply.build, longreply.hit, True, "1024,2048", 10, 256, needs_full=True,
    ),
}  # fmt: skip


def reply(tok, ids: list[int], chat: bool) -> str:
    """A reply as text. A chat reply ends at the model's end of turn (generation runs on past it, so that every
    request decodes the same number of steps); a plain completion is taken whole, as the tuning suite always was."""
    if chat:
        stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None, tok.unk_token_id}
        ids = next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)
        return tok.decode(ids, skip_special_tokens=True)
    return tok.decode(ids)
