"""Pressure mode's shedding: how many tokens each request gives up so that the pool covers a shortfall of blocks
with the fewest tokens evicted. Plain Python; the compactor (vtoken/core/compactor.py) asks it, the tests hold it to a
brute force.

A request that writes ``w`` tokens in its next forward on top of ``n`` physical tokens holds
``H = max(blocks now, ceil((n + w) / B))`` blocks during that forward. Shedding ``c`` of its tokens (packing the
rest) makes it hold ``ceil((n + w - c) / B)``: to give back ``g`` blocks it sheds ``c(g) = n + w - B * (H - g)``
tokens. The first block it gives back costs what its last block holds (at most ``B``), every further block ``B``.
A request may shed only down to its budget (``most``: its live tokens above what its policy keeps).

The order, and why:
  1. the fewest tokens first: a block that is nearly empty costs fewer tokens than a full one, and every token
     evicted is a token an answer might need. Taking the cheapest block each time is optimal here, because each
     request's costs do not decrease (its first block costs at most B, the others B);
  2. among equal costs, requests that have read their prompt before those still reading it: their statistics
     have seen the question, while a request still reading parks what it sheds (it is chosen again with the
     question, so its loss is not final, but its choice is less informed now);
  3. then the request holding most above its budget (the loss is the smallest share of what it holds);
  4. then the request id (a total order: every TP rank and every rerun decides the same).
Which tokens a request sheds is its policy's choice: its lowest-scored candidates.

With ``pressure_floor`` (a share of each request's tokens, above its budget) the same order runs twice: first over
what each request holds above its floor, then, only if that cannot cover the shortfall (the running requests' own
forwards need more), over what lies between floor and budget (``plan_sheds_above``). Admission keeps the first
pass sufficient for the waiting requests: one is admitted only while every request fits at its floor
(``admissible``, ``reserved_blocks``); otherwise it waits, as in stock vLLM, instead of being paid for with
answers.

Admission's rules live here, beside ``admissible``, because they are the other half of the same promise: at the
floors (``admit_at_floors``), and in the parking tier (``admit_to_tier``: each request reserves what it may park
at most, ``tier_need``). The compactor asks them with its running requests' figures (Compactor.admissible,
Compactor.tier_admissible).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vtoken.core.budget import kept_tokens


class Holder(NamedTuple):
    """One request that may shed, as the planner sees it."""

    writing_len: int  # n + w: its physical tokens once its next forward has written its new ones
    holds: int  # H: blocks it holds during its next forward if it sheds nothing
    most: int  # tokens it may shed: its live tokens above its budget that its policy may evict
    reading: bool  # still reading its prompt
    request_id: str


def tokens_for(h: Holder, blocks: int, block_size: int) -> int:
    """Tokens ``h`` sheds to give back ``blocks`` blocks (at least one token: nothing moves without a victim)."""
    return max(1, h.writing_len - block_size * (h.holds - blocks)) if blocks else 0


def plan_sheds(holders: list[Holder], shortfall: int, block_size: int) -> list[int]:
    """Tokens each holder sheds: the blocks they give back cover ``shortfall`` (as far as their budgets allow) and
    no other choice covers it with fewer tokens; ties broken in the module's order. O(holders * shortfall)."""
    if shortfall <= 0:
        return [0] * len(holders)
    offers = []  # (marginal tokens, order of the holder, blocks given back so far + 1, holder)
    for i, h in enumerate(holders):
        rank = (h.reading, -h.most, h.request_id)
        before = 0
        for g in range(1, min(h.holds, shortfall) + 1):
            cost = tokens_for(h, g, block_size)
            if cost > h.most:
                break
            offers.append((cost - before, rank, g, i))
            before = cost
    taken = [0] * len(holders)
    for _, _, g, i in sorted(offers)[:shortfall]:
        taken[i] = max(taken[i], g)
    return [tokens_for(h, g, block_size) for h, g in zip(holders, taken)]


def blocks_given(h: Holder, tokens: int, block_size: int) -> int:
    """Blocks ``h`` gives back when it sheds ``tokens`` (and packs the rest)."""
    return max(h.holds - -(-(h.writing_len - tokens) // block_size), 0) if tokens else 0


def plan_sheds_above(holders: list[Holder], above: list[int], shortfall: int, block_size: int) -> list[int]:
    """``pressure_floor``: the holders shed first only what they hold above their floors (``above``: tokens each
    may shed before it reaches its floor), as ``plan_sheds`` chooses; what is still short then comes from what
    they hold between floor and budget, chosen the same way. Lexicographic: no token below a floor is shed while
    a block above the floors would cover the shortfall."""
    first = plan_sheds([h._replace(most=min(h.most, a)) for h, a in zip(holders, above)], shortfall, block_size)
    given = [blocks_given(h, c, block_size) for h, c in zip(holders, first)]
    if sum(given) >= shortfall:
        return first
    rest = [
        h._replace(writing_len=h.writing_len - c, holds=h.holds - g, most=h.most - c)
        for h, c, g in zip(holders, first, given)
    ]
    second = plan_sheds(rest, shortfall - sum(given), block_size)
    return [a + b for a, b in zip(first, second)]


def floor_tokens(length: int, keep: int, floor: float) -> int:
    """Live tokens a request of ``length`` tokens keeps at its floor: ``floor`` of them, and at least ``keep``
    (its budget)."""
    return max(keep, math.ceil(floor * length))


def reserved_blocks(length: int, keep: int, floor: float, writing: int, block_size: int) -> int:
    """Blocks a request of ``length`` tokens holds at its floor (``floor_tokens``) while a forward writes
    ``writing`` new tokens: what admission sets aside for it under ``pressure_floor``."""
    return -(-(floor_tokens(length, keep, floor) + writing) // block_size)


def admissible(reserved: int, waiting: list[int], capacity: int) -> int:
    """How many of the waiting requests, in order, the pool admits: each reserves ``waiting[i]`` blocks, the running
    ones ``reserved`` together, and all of it fits in ``capacity``. Admission stops at the first that does not fit
    (first come, first served); with nothing running the first is admitted whatever it reserves (it would wait
    forever otherwise, and its own growth sheds down to its budget)."""
    k = 0
    for need in waiting:
        if reserved + need > capacity and (reserved or k):
            break
        reserved += need
        k += 1
    return k


def admit_at_floors(
    running: Iterable[tuple[int, int, float]],
    waiting: Sequence[tuple[int, int, float]],
    pool_blocks: int,
    watermark: int,
    chunk: int,
    block_size: int,
) -> int:
    """``pressure_floor``: how many of the waiting requests, in the order the engine admits them, may be admitted so
    that every request fits in the pool at its floor (``admissible``). Each request, running or waiting, is (its
    tokens, the tokens its budget keeps of them, its floor: 0 in always mode): one in always mode reserves its
    budget, one in pressure mode its floor, each with the token it writes next. ``pool_blocks`` (usable blocks) less
    the ``watermark`` is what they share; one prefill chunk (``chunk`` tokens) is set aside for all (a request
    reading its prompt holds its next chunk on top of its floor; more than one such chunk at once sheds towards
    the budgets instead)."""
    reserved = 0
    for length, keep, floor in running:
        reserved += reserved_blocks(length, keep, floor, 1, block_size)
    need = [reserved_blocks(n, keep, floor, 1, block_size) for n, keep, floor in waiting]
    return admissible(reserved, need, pool_blocks - watermark - -(-chunk // block_size))


def tier_need(policy, max_len: int) -> int:
    """What a request may park at most: its tokens at its longest (``max_len``) less what its budget keeps (0 for
    a policy that scores nothing, and so parks nothing)."""
    if not policy.needs:
        return 0
    return max(0, int(max_len) - kept_tokens(int(max_len), policy.budget, policy.sink, policy.recent))


def admit_to_tier(reserved: int, waiting: Sequence[int], capacity: int) -> int:
    """How many of the waiting requests, in order, a parking tier of ``capacity`` slots admits: the running ones
    reserve ``reserved`` slots together (their ``tier_need``), each waiting one ``waiting[i]`` (at most the whole
    tier), so a request is never admitted into a tier that cannot hold what it will park. With nothing running the
    first is admitted whatever it reserves (``admissible``)."""
    return admissible(reserved, [min(n, capacity) for n in waiting], capacity)
