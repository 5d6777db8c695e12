"""How many tokens a request keeps, and how many blocks it holds: the one rule the compactor, placement and the
fleet simulator share. Plain Python (no NumPy, no torch), so the gateway imports it for free.

    target(n)  = ceil(budget * n) (at least 1) for a ratio budget (< 1); the count itself for budget >= 1
    keep(n)    = max(target(n), min(n, sink + recent))    what the policy may leave at n tokens read
    live(n)    = min(n, keep(n))                           what a request evicting to its budget holds

A forward that writes ``new`` tokens on top of ``n`` already read holds at most ``ceil((keep(n) + new) / B) + 1``
blocks (vtoken_stats' ``peak_over_bound`` <= 0; docs/concepts.md's "bound"): the kept tokens packed, the new ones, and
the block being filled.
"""

from __future__ import annotations

import math


def target_tokens(n: int, budget: float) -> int:
    """Live tokens the budget keeps at a context of ``n`` tokens (``budget``: a ratio < 1, or a count)."""
    if budget < 1:
        return max(1, math.ceil(budget * n))
    return int(budget)


def kept_tokens(n: int, budget: float, sink: int, recent: int) -> int:
    """Live tokens the policy may leave at ``n`` tokens: its budget, unless the sink and recent tokens hold more."""
    return max(target_tokens(n, budget), min(n, sink + recent))


def live_tokens(n: int, budget: float | None, sink: int, recent: int) -> int:
    """Live tokens of a request that keeps to its budget at ``n`` tokens (all of them without a budget)."""
    return n if not budget else min(n, kept_tokens(n, budget, sink, recent))


def forward_bound(n: int, new: int, block_size: int, budget: float, sink: int, recent: int, slack: int = 0) -> int:
    """Blocks a request may hold during a forward writing ``new`` tokens after ``n`` (vtoken mode's bound, the one
    ``vtoken_stats`` checks: ``keep(n)`` even where fewer than ``keep(n)`` tokens were read). ``slack``: tokens a
    decoding request may hold above ``keep(n)`` between two decisions (its interval less one; with the default of
    a block, the bound gains at most one block)."""
    return -(-(kept_tokens(n, budget, sink, recent) + slack + new) // block_size) + 1


def _held(n: int, new: int, block_size: int, budget: float, sink: int, recent: int, slack: int = 0) -> int:
    """The bound with what a request really has at ``n`` tokens read (``live(n)``, never more than ``n``)."""
    return -(-(min(live_tokens(n, budget, sink, recent) + slack, n) + new) // block_size) + 1


def peak_blocks(
    prompt: int,
    max_tokens: int,
    block_size: int,
    budget: float | None = None,
    sink: int = 0,
    recent: int = 0,
    chunk: int | None = None,
    prefill_evict: bool = True,
    interval: int = 1,
) -> int:
    """The most blocks a request will hold during any of its forwards: what placement reserves for it.

    Without a budget: its whole context, plus the block being filled. With one, the bound of its largest forward:
    with ``prefill_evict`` a prompt read in chunks of ``chunk`` tokens (None: in one forward) keeps to its budget at
    every chunk boundary, so the largest prefill forward holds ``keep(n) + chunk``; without it the whole prompt is
    held before the first eviction. Decode forwards write one token each on top of ``keep(n)`` and the ``interval - 1``
    tokens a decoding request may hold above it between two decisions. O(prompt / chunk).
    """
    if not budget:
        return max(1, -(-(prompt + max_tokens) // block_size) + 1)
    peak = 1
    if prefill_evict:
        step = chunk or prompt
        for start in range(0, prompt, max(step, 1)):
            peak = max(peak, _held(start, min(step, prompt - start), block_size, budget, sink, recent))
    else:  # the whole prompt, and the first decode forward's token before the first eviction
        peak = -(-(prompt + (max_tokens > 1)) // block_size) + 1
    if max_tokens > 1:  # decode forwards read n = prompt .. prompt + max_tokens - 2; keep(n) grows with n
        peak = max(peak, _held(prompt + max_tokens - 2, 1, block_size, budget, sink, recent, interval - 1))
    return peak
