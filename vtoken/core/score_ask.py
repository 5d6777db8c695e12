"""What the worker scores for one request's forward (``ScoreAsk``), from its phase (vtoken/core/phase.py), its
schedule (vtoken/core/schedule.py: when it may decide) and its parked tokens. Plain Python; the compactor asks it
once for each forward vLLM scheduled (``Compactor.scheduled``), after recording the forward.

    prefill chunk   the chunk's last queries, when its boundary may decide; the chunk that ends one token before
                    the prompt does, with tokens parked: every query over live and parked keys (one softmax)
    decode step     its query, at the steps its schedule observes; kept in the request's window (on-demand
                    policies); the window scored after the forward at a decision, and over its parked keys too
                    when a recall is due (a decoding request at its decisions, a keeping one every recall_every)

A request whose policy scores nothing is asked nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vtoken.core.phase import Phase
from vtoken.core.request_state import RequestState


class ScoreAsk(NamedTuple):
    """What the worker computes for one request in this step's forward."""

    queries: int  # how many of the forward's last queries to score (1 for a decode step; 0: none)
    export: tuple[str, ...]  # statistics to send back after the forward (empty: keep accumulating)
    parked: np.ndarray | None = None  # tier slots scored with the live keys in one softmax (the last chunk)
    record: bool = False  # keep this decode step's query in the request's window (on-demand policies)
    window: tuple[str, ...] = ()  # score the window of recent queries after the forward, and send these back
    window_parked: np.ndarray | None = None  # recall: the window is scored over these tier slots too


def score_ask(
    st: RequestState, new_tokens: int, num_computed_after: int, num_output: int, prefill: bool
) -> ScoreAsk | None:
    """What the worker scores for the forward of ``new_tokens`` tokens that brings ``st`` to ``num_computed_after``
    (``prefill``: it (re)computes tokens the request had when admitted), or None. A decode step that makes a recall
    due notes it (``st.recalled_at``)."""
    p, sched = st.policy, st.schedule
    if not p.needs:
        return None
    live = st.table.num_live
    if not prefill:  # decode
        excess = live + new_tokens - st.keep(num_computed_after)
        decides = st.phase is Phase.DECODING and sched.decides_after(excess)
        observe, export, window = sched.decode_ask(num_output + 1, decides)  # the step this forward completes
        if st.phase is Phase.KEEPING and observe:
            export = True  # pressure mode, per-step statistics: a shed may come at any step
        parked = st.parked.size > 0 and sched.recall_every > 0
        record = sched.on_demand and (st.phase is Phase.DECODING or parked)
        # A decoding request recalls at its own decisions (once per slack); a keeping one every recall_every.
        due = window if st.phase is Phase.DECODING else sched.recalls_at(num_output + 1, st.recalled_at)
        recall = parked and due
        if recall:  # its window is scored over live and parked keys, and the next decision chooses among both
            window, st.recalled_at = True, num_output + 1
        if not (observe or record):
            return None
        return ScoreAsk(int(observe), p.needs if export else (), record=record, window=p.needs if window else (),
                        window_parked=st.parked.tier.copy() if recall else None)  # fmt: skip
    over = live + new_tokens > p.target(num_computed_after)
    queries = sched.chunk_queries(new_tokens, num_computed_after, st.prefill_len, over)
    if sched.scores_jointly(st.parked.size > 0, num_computed_after, st.prefill_len):
        # All but the prompt's last token: the question. Every query of this chunk attends the live and the
        # parked keys in one softmax, so its hidden states, its window's scores (which choose the survivors)
        # and the first answer token see the whole prompt; the choice follows, and the last token's forward,
        # which samples, sees the survivors.
        st.record.saw_parked(st.parked.logical)
        return ScoreAsk(min(st.window, new_tokens), p.needs, st.parked.tier.copy())
    return ScoreAsk(queries, p.needs) if queries else None
