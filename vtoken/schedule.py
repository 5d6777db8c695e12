"""Schedule: WHEN a request may evict, which queries the worker scores for it, and when parking's last chunk stops
short and its parked tokens are chosen. The policy says WHAT goes (vtoken/policies/: ``score()`` and the top-k);
this says when it may be asked. One small object per request that the compactor (the engine and the property
tests), replay, the quality benchmark and the retrieval benchmark share, as kvpress wraps a ``ScorerPress`` (what)
in a ``DecodingPress`` (when).

A request's forwards are PREFILL chunks until it has read ``prefill_len`` tokens, then decode steps. Points at
which its policy may evict, given the tokens computed so far and the outputs sampled:

    chunk boundary              only with ``prefill_evict``; policy step 0
    the boundary after the last chunk (every chunk boundary evicts whatever the interval)
    decode step s               every ``interval`` steps (s % interval == 0)
    a shed (pressure mode)      at any decision point, whatever the interval (the pool is short now); step 0

A policy that reads attention statistics decides only with statistics from the forward just run: a decode
query (one step in ``score_every`` is observed) or a chunk's observation window (its last ``window`` queries),
which is scored only when the boundary after it may evict. ``eager``: every chunk window and every observed
decode step is scored and exported, because any step may have to shed tokens (``evict: "pressure"``).

Parking (vtoken/park.py) adds two points, both for a request with parked tokens: the prompt's last chunk stops one
token short (``stops_short``), so its window (the question) is scored over live and parked keys together
(``scores_jointly``), and the boundary one token before the prompt's end chooses among both (``chooses``).
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
        """The schedule a policy's timing parameters (``interval``, ``score_every``) ask for."""
        return cls(prefill_evict, policy.interval, policy.score_every, bool(policy.needs), window, eager)

    def step_at(self, num_logical: int, prefill_len: int, num_output: int) -> int | None:
        """The policy step of the point reached with ``num_logical`` tokens computed (0 at a chunk boundary, the
        decode step otherwise), or None where no eviction may happen whatever the interval."""
        if num_logical == 0:
            return None
        if num_logical < prefill_len:
            return 0 if self.prefill_evict else None
        if num_logical == prefill_len and self.prefill_evict:
            return 0  # the boundary after the last chunk evicts whatever the interval
        return num_output

    def decision_step(self, num_logical: int, prefill_len: int, num_output: int, shed: bool = False) -> int | None:
        """The policy step of a decision now (``PolicyInput.step``), or None when the request may not evict now.
        ``shed``: pressure mode sheds at any point where eviction may happen, as step 0."""
        step = self.step_at(num_logical, prefill_len, num_output)
        if step is None:
            return None
        if shed:
            return 0
        return None if step % self.interval else step

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
        """At ``num_logical`` tokens the next decision chooses among live and parked tokens: the question has been
        read (all of the prompt but at most its last token)."""
        return parked and num_logical >= prefill_len - 1
