"""Phase: where a request is in its life on the compactor, and the transitions it may make.

    reading  --its prompt read-->                                      decoding
    reading  --its prompt read but the last token, tokens parked-->    choosing
    keeping  --its prompt read but the last token, tokens parked-->    choosing   (pressure mode)
    choosing --live and parked tokens chosen with the question-->      reading (its last prompt token still to
                                                                       read) | decoding | keeping (pressure mode)

A request starts ``keeping`` in pressure mode (``evict: "pressure"``) and stays so (but for its choice with the
question), else ``reading``. What each phase does at a decision point (vtoken/core/compactor.py ``plan_step``; when a
decision point comes is vtoken/core/schedule.py's business):

    keeping   keeps every token until the pool runs short; then gives back what the shortfall needs, never below
              its budget (vtoken/core/shedding.py), parking what it sheds; once its prompt is read it recalls
              parked tokens every recall_every decode steps, and gets them back when the pool has room again
    reading   evict to the budget at chunk boundaries; with a parking tier the victims are parked
    choosing  choose among live and parked tokens by the last chunk's window (the question); parked winners return
    decoding  evict to the budget at decode steps, parking what it evicts and recalling among live and parked

Every change goes through ``Compactor._to``, which checks it against ``TRANSITIONS`` and logs it (debug).
"""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    KEEPING = "keeping"  # pressure mode: keeps every token it can, gives back only what the pool is short
    READING = "reading"  # reading its prompt, keeping to its budget at chunk boundaries (parking what drops)
    CHOOSING = "choosing"  # the question read, tokens parked: the next decision chooses among live and parked
    DECODING = "decoding"  # its prompt read: keeps to its budget at decode steps

    def evicts(self) -> bool:
        """Keeps to its budget now (every phase but ``keeping``)."""
        return self is not Phase.KEEPING


P = Phase
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    P.KEEPING: frozenset({P.CHOOSING}),
    P.READING: frozenset({P.CHOOSING, P.DECODING}),
    P.CHOOSING: frozenset({P.READING, P.DECODING, P.KEEPING}),
    P.DECODING: frozenset(),
}


class InvalidPhase(RuntimeError):
    """A transition not in ``TRANSITIONS``: a bug in the compactor, never a user error."""


def check_phase(request_id: str, frm: Phase, to: Phase, why: str) -> None:
    if to not in TRANSITIONS[frm]:
        allowed = ", ".join(sorted(TRANSITIONS[frm])) or "nothing"
        raise InvalidPhase(f"request {request_id}: {frm} -> {to} ({why}); from {frm} it may go to {allowed}")
