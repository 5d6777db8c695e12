"""Schedule: WHEN a request may evict and which queries the worker scores for it. The policy says WHAT goes
(vtoken/policies/); this says when it may be asked. One small object that the compactor (the engine and the
property tests), the quality benchmark and the retrieval benchmark share, as kvpress wraps a ``ScorerPress``
(what) in a ``DecodingPress`` (when).

A request's forwards are PREFILL chunks until it has read ``prefill_len`` tokens, then decode steps. Points at
which its policy may evict, given the tokens computed so far and the outputs sampled:

    chunk boundary              only with ``prefill_evict``; policy step 0
    the boundary after the last chunk (every chunk boundary evicts whatever the interval)
    decode step s               every ``interval`` steps (the policy checks ``s % interval``)

A policy that reads attention statistics decides only with statistics from the forward just run: a decode
query (one step in ``score_every`` is observed) or a chunk's observation window (its last ``window`` queries),
which is scored only when the boundary after it may evict. ``eager``: every chunk window and every observed
decode step is scored and exported, because any step may have to shed tokens (``evict: "pressure"``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    prefill_evict: bool = True
    interval: int = 1
    score_every: int = 1
    scores: bool = False  # the policy reads attention statistics
    window: int = 32  # queries of a prefill chunk's observation window
    eager: bool = False  # pressure mode: score and export at every chance (any step may shed)

    @classmethod
    def of(cls, policy, prefill_evict: bool = True, window: int = 32, eager: bool = False) -> Schedule:
        return cls(prefill_evict, policy.interval, policy.score_every, bool(policy.needs), window, eager)

    def step_at(self, num_logical: int, prefill_len: int, num_output: int) -> int | None:
        """The policy step of the decision point reached with ``num_logical`` tokens computed (0 at a chunk
        boundary, the decode step otherwise), or None where no eviction may happen."""
        if num_logical == 0:
            return None
        if num_logical < prefill_len:
            return 0 if self.prefill_evict else None
        if num_logical == prefill_len and self.prefill_evict:
            return 0  # the boundary after the last chunk evicts whatever the interval
        return num_output

    def chunk_queries(self, new_tokens: int, after: int, prefill_len: int, num_output: int, over: bool) -> int:
        """Queries of a prefill chunk of ``new_tokens`` (ending at ``after`` tokens) to score: its window if the
        boundary after it may evict (``over``: the request will hold more than its budget then), else 0."""
        if not self.scores or not self.prefill_evict:
            return 0
        step = self.step_at(after, prefill_len, num_output + 1)
        if step is None or (not self.eager and (step % self.interval or not over)):
            return 0
        return min(self.window, new_tokens)

    def decode_ask(self, step: int) -> tuple[bool, bool]:
        """(observe, export) for the forward that completes decode step ``step``: a policy with attention
        statistics accumulates every observed step and exports them when the next decision may evict."""
        if not self.scores or step % self.score_every:
            return False, False
        return True, self.eager or step % self.interval == 0
