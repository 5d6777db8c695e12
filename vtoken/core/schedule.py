"""Schedule: WHEN a request may evict, which queries the worker scores for it, and when parking's last chunk stops
short and its parked tokens are chosen. The policy says WHAT goes (vtoken/core/policies/: ``score()`` and the top-k);
this says when it may be asked. One small object per request that the compactor (the engine and the property
tests), replay, the quality benchmark and the retrieval benchmark share, as kvpress wraps a ``ScorerPress`` (what)
in a ``DecodingPress`` (when).

A request's forwards are PREFILL chunks until it has read ``prefill_len`` tokens, then decode steps. Points at
which its policy may evict, given the tokens computed so far and the outputs sampled:

    chunk boundary              only with ``prefill_evict``; policy step 0
    the boundary after the last chunk (every chunk boundary evicts)
    decode step s               once the request holds ``slack`` tokens more than it keeps (``keep(n)``,
                                vtoken/core/budget.py): decisions come in batches, and evict back to ``keep(n)``
    a shed (pressure mode)      at any decision point, whatever the slack (the pool is short now); step 0

``slack`` is the policies' ``interval``: 1 decides at every decode step (exact per-step eviction), the default
(``interval="block"``) a KV block, so a decoding request decides and compacts about once per block instead of once
per token, and holds at most one block more than it keeps (the bound says so: ``budget.forward_bound``).

A policy that reads attention statistics decides only with statistics from the forward just run: a chunk's
observation window (its last ``window`` queries), scored only when the boundary after it may evict, and, while
decoding, either every observed decode query (``per step``: h2o, scissorhands, whose definitions accumulate them;
one step in ``score_every``), exported before a decision, or (``on_demand``: snapkv) the last queries of the
request kept in a window the worker fills as it decodes (vtoken/kv/query_window.py) and scores once, just before a
decision: no per-step scorer at all. ``eager`` (pressure mode): every chunk window is scored, because any chunk
boundary may shed; a decoding request that keeps every token has its window recorded and scored only when the
pool may run short soon, which is a question about the pool, not the request (``Compactor.foresee``; ``slack``
still spaces the scorings).

Recall (vtoken/core/recall.py ``Recall.while_decoding``): a decoding request with parked tokens has its window
scored over its live and parked keys every ``recall_every`` decode steps (and at each of its decisions), and
chooses again among both.

Parking (vtoken/core/park.py) adds two points, both for a request with parked tokens: the prompt's last chunk stops one
token short (``stops_short``), so that chunk (the question) attends the live and the parked keys together
(``scores_jointly``), and the boundary one token before the prompt's end chooses among both (``chooses``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    prefill_evict: bool = True
    slack: int = 1  # tokens a decoding request holds above what it keeps before it decides (the policy's interval)
    score_every: int = 1
    scores: bool = False  # the policy reads attention statistics
    window: int = 32  # queries of a prefill chunk's observation window
    eager: bool = False  # pressure mode: score every chunk window (any boundary may shed)
    on_demand: bool = False  # decode statistics from the window of recent queries, scored once before a decision
    recall_every: int = 0  # decode steps between two recalls of a request with parked tokens (0: never)

    @classmethod
    def of(
        cls,
        policy,
        prefill_evict: bool = True,
        window: int = 32,
        eager: bool = False,
        block_size: int = 1,
        recall_every: int = 0,
    ) -> Schedule:
        """The schedule a policy's timing parameters ask for (``interval`` 0: one KV block of ``block_size``).
        ``recall_every``: recall's cadence, for a policy that scores a window of decode queries (on demand)."""
        slack = policy.interval or block_size
        on_demand = bool(policy.needs) and policy.window_scores
        return cls(prefill_evict, slack, policy.score_every, bool(policy.needs), window, eager, on_demand,
                   recall_every if on_demand else 0)  # fmt: skip

    def recalls_at(self, step: int, last: int) -> bool:
        """Is decode step ``step`` a recall point for a request with parked tokens whose last recall came at decode
        step ``last``? Every ``recall_every`` steps (its window then holds the queries since)."""
        return bool(self.recall_every) and step - last >= self.recall_every

    def step_at(self, num_logical: int, prefill_len: int, num_output: int) -> int | None:
        """The policy step of the point reached with ``num_logical`` tokens computed (0 at a chunk boundary, the
        decode step otherwise), or None where no eviction may happen at all."""
        if num_logical == 0:
            return None
        if num_logical < prefill_len:
            return 0 if self.prefill_evict else None
        if num_logical == prefill_len and self.prefill_evict:
            return 0  # the boundary after the last chunk evicts whatever the slack
        return num_output

    def decision_step(
        self, num_logical: int, prefill_len: int, num_output: int, excess: int, shed: bool = False
    ) -> int | None:
        """The policy step of a decision now (``PolicyInput.step``), or None when the request may not evict now.
        ``excess``: the live tokens it holds above what it keeps (a decode step decides once they reach the
        slack). ``shed``: pressure mode sheds at any point where eviction may happen, as step 0."""
        step = self.step_at(num_logical, prefill_len, num_output)
        if step is None:
            return None
        if shed:
            return 0
        if step and excess < self.slack:  # a decode step: decisions in batches
            return None
        return step

    def decides_after(self, excess_after: int) -> bool:
        """Will the point reached after a decode forward be a decision (``excess_after``: the live tokens the request
        holds above what it keeps then)? Its statistics must come from that forward."""
        return excess_after >= self.slack

    def chunk_queries(self, new_tokens: int, after: int, prefill_len: int, over: bool) -> int:
        """Queries of a prefill chunk of ``new_tokens`` (ending at ``after`` tokens) to score: its window if the
        boundary after it may evict (``over``: the request will hold more than its budget then), else 0."""
        if not self.scores or not self.prefill_evict:
            return 0
        return min(self.window, new_tokens) if self.eager or over else 0

    def decode_ask(self, step: int, decides: bool) -> tuple[bool, bool, bool]:
        """(observe, export, window) for the forward that completes decode step ``step``, before a decision or not:
        a per-step policy observes one step in ``score_every`` and exports what it accumulated before a decision;
        an on-demand policy observes nothing, and its window of recent queries is scored before a decision."""
        if not self.scores:
            return False, False, False
        if self.on_demand:
            return False, False, decides
        observe = step % self.score_every == 0
        return observe, observe and decides, False

    # ------------------------------------------------------------------ parking
    @staticmethod
    def stops_short(parked: bool, new_tokens: int, after: int, prefill_len: int) -> bool:
        """A forward of ``new_tokens`` ending at ``after`` tokens stops one token before the end of the prompt: yes
        for a request with parked tokens whose forward would read its last prompt token. The forward that samples
        the first output must come after the choice among live and parked tokens, or the answer's first token is
        read without the parked facts."""
        return parked and new_tokens > 1 and after == prefill_len

    @staticmethod
    def scores_jointly(parked: bool, after: int, prefill_len: int) -> bool:
        """The forward ending at ``after`` is the last chunk of a request with parked tokens (all of the prompt but
        its last token): its window is scored over live and parked keys in one softmax."""
        return parked and after == prefill_len - 1

    @staticmethod
    def chooses(parked: bool, num_logical: int, prefill_len: int) -> bool:
        """At ``num_logical`` tokens the next decision chooses among live and parked tokens: the question has just
        been read (all of the prompt but at most its last token). Later, while decoding, parked tokens come back
        by recall (``recalls``), not by this choice."""
        return parked and prefill_len - 1 <= num_logical <= prefill_len
