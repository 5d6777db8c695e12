"""What a replica's prefix cache holds, from vLLM's KV events to the controller's index (issue 43, item 2), without an
engine or Ray: the hash chain the gateway computes, the replica's PrefixTracker (vLLM's hashes -> ours, deltas), the
controller's PrefixIndex (deltas in order, a snapshot after a gap), and the controller itself following stores,
removals, restarts, gaps and deaths, and a gateway's copy of an index following it. Integrity is checked after
every operation."""

from __future__ import annotations

import random

import pytest

from actors.prefix_tracker import PrefixTracker
from actors.report import PrefixDelta
from cluster.placement import prefix_index
from cluster.placement.prefix_index import PrefixIndex, with_prefix
from vtoken.prefix_hash import ROOT, block_hash, prefix_hashes

BS = 4


# ------------------------------------------------------------------------------ the hash chain
def test_the_chain_names_a_block_with_everything_before_it():
    a = prefix_hashes(list(range(10)), BS)
    assert len(a) == 2  # full blocks only
    assert a[0] == block_hash(ROOT, [0, 1, 2, 3]) and a[1] == block_hash(a[0], [4, 5, 6, 7])
    b = prefix_hashes([0, 1, 2, 3, 4, 5, 6, 99, 8], BS)
    assert b[0] == a[0] and b[1] != a[1]  # the same first block, a different second
    c = prefix_hashes([9, 1, 2, 3, 4, 5, 6, 7], BS)
    assert c[1] != a[1]  # the same tokens after a different first block: another block
    assert prefix_hashes(list(range(8)), BS) == a == prefix_hashes(list(range(11)), BS)
    assert prefix_hashes(list(range(3)), BS) == ()
    assert all(0 <= h < 1 << 64 for h in a)
    assert prefix_hashes([-1, 1 << 40, 3, 4], BS)  # out of int32: hashed, never an error
    with pytest.raises(ValueError):
        prefix_hashes([1], 0)


# ------------------------------------------------------------------------------ the replica's tracker
def stored(t: PrefixTracker, tokens: list[int], parent=None, vllm=lambda h: ("v", h)) -> list:
    """Store ``tokens``' full blocks as vLLM announces them: its own hashes (here a function of ours), the parent's."""
    ours = prefix_hashes(tokens, BS, parent[1] if parent else ROOT)
    theirs = [vllm(h) for h in ours]
    t.stored(theirs, parent, tokens[: len(ours) * BS], BS)
    t.check_integrity()
    return theirs


def test_the_tracker_translates_vllm_blocks_to_the_gateways_hashes_and_cuts_deltas():
    t = PrefixTracker(BS, capacity=16)
    prompt = list(range(12))
    v = stored(t, prompt[:8])
    stored(t, prompt[8:12], parent=v[-1])  # a block stored later, after its parent (decode filled it)
    assert t.hashes() == set(prefix_hashes(prompt, BS))
    d = t.cut()
    assert d.seq == 1 and set(d.added) == set(prefix_hashes(prompt, BS)) and d.removed == () and not d.full
    assert t.cut() == PrefixDelta(1)  # nothing changed: an empty delta under the last number
    t.removed([v[1]])
    t.check_integrity()
    assert t.cut() == PrefixDelta(2, (), (prefix_hashes(prompt, BS)[1],))
    t.removed([v[0]])
    stored(t, prompt[:4])  # removed and stored again between two cuts: no change at all
    assert t.cut() == PrefixDelta(2)
    full = t.cut(full=True)
    assert full.full and full.seq == 3 and set(full.added) == t.hashes()
    t.cleared()
    t.check_integrity()
    assert t.hashes() == frozenset() and set(t.cut().removed) == set(full.added)


def test_the_tracker_skips_what_no_prompt_can_read_or_it_cannot_name():
    t = PrefixTracker(BS, capacity=16)
    t.stored([("v", 1)], ("v", "unknown parent"), [1, 2, 3, 4], BS)
    t.stored([("v", 2)], None, [1, 2, 3, 4, 5, 6, 7, 8], 8)  # another block size than the gateway's
    t.stored([("v", 3), ("v", 4)], None, [1, 2, 3, 4, 5], BS)  # the second block's tokens are missing
    t.check_integrity()
    assert t.hashes() == {block_hash(ROOT, [1, 2, 3, 4])} and t.ignored == 3


def test_two_vllm_blocks_with_one_hash_of_ours_count_until_both_are_gone():
    """vLLM's hash also covers a cache salt or a LoRA; ours only the tokens."""
    t = PrefixTracker(BS, capacity=16)
    a = stored(t, [1, 2, 3, 4], vllm=lambda h: ("salt-a", h))
    b = stored(t, [1, 2, 3, 4], vllm=lambda h: ("salt-b", h))
    t.cut()
    t.removed(a)
    t.check_integrity()
    assert t.cut() == PrefixDelta(1) and len(t.hashes()) == 1
    t.removed(b)
    assert t.cut().removed == (block_hash(ROOT, [1, 2, 3, 4]),)


def test_the_tracker_is_bounded_and_drops_the_oldest_first():
    t = PrefixTracker(BS, capacity=3)
    for i in range(5):
        stored(t, [i] * BS)
    assert t.hashes() == {block_hash(ROOT, [i] * BS) for i in (2, 3, 4)}
    assert len(t.engine) == 3


# ------------------------------------------------------------------------------ the controller's index
def test_the_index_applies_deltas_in_order_and_waits_for_a_snapshot_after_a_gap():
    ix = PrefixIndex(capacity=8)
    assert ix.apply(PrefixDelta(1, (1, 2, 3)))
    assert ix.match([1, 2, 3, 4]) == 3 and ix.match([5, 1]) == 0 and ix.match([]) == 0
    assert ix.apply(PrefixDelta(2, (4,), (2,)))
    assert ix.match([1, 2, 3]) == 1  # vLLM stops at the first block it lacks
    assert ix.apply(PrefixDelta(2))  # nothing changed since delta 2
    ix.check_integrity()
    assert not ix.apply(PrefixDelta(4, (9,)))  # delta 3 was lost: everything is in doubt
    assert len(ix) == 0 and not ix.synced
    ix.check_integrity()
    assert not ix.apply(PrefixDelta(5, (9,)))  # still no snapshot
    assert ix.apply(PrefixDelta(6, (1, 3, 4, 9), full=True))
    assert ix.synced and ix.match([1, 3, 4]) == 3
    assert ix.apply(PrefixDelta(7, (), (9,)))
    ix.check_integrity()


def test_the_index_is_bounded_and_drops_the_oldest_first():
    ix = PrefixIndex(capacity=3)
    ix.apply(PrefixDelta(1, (1, 2, 3)))
    ix.apply(PrefixDelta(2, (4, 1)))  # 1 again: now the newest
    assert set(ix.hashes) == {3, 4, 1}
    ix.apply(PrefixDelta(3, tuple(range(10, 20)), full=True))
    assert set(ix.hashes) == {17, 18, 19}
    ix.check_integrity()


def replay(seed: int, new_index=lambda: PrefixIndex(capacity=24)) -> bool:
    """Random stores, removals and clears; reports cut deltas, some lost on the way (the replica then sends a
    snapshot, as Replica._send does), and now and then the controller forgets the index (a controller restart, a
    replica dropped and serving again) without the replica knowing: it asks for a snapshot at the gap, as
    Controller.report does. True when, after every report that arrived and left no gap, the index held exactly what
    the tracker held."""
    rng = random.Random(seed)
    t, index = PrefixTracker(BS, capacity=24), new_index()
    seqs: list[list[int]] = [[rng.randrange(6) for _ in range(BS * rng.randrange(1, 5))] for _ in range(8)]
    snapshot = False
    for _ in range(120):
        op = rng.random()
        if op < 0.5:
            stored(t, rng.choice(seqs))
        elif op < 0.8 and t.engine:
            t.removed([rng.choice(list(t.engine))])
        elif op < 0.83:
            t.cleared()
        t.check_integrity()
        if rng.random() < 0.05:
            index = new_index()
        if rng.random() < 0.4:  # a report
            d = t.cut(full=snapshot)
            snapshot = True  # until the controller answers
            if rng.random() < 0.25:  # lost on the way (or its answer was)
                continue
            snapshot = not index.apply(d)
            index.check_integrity()
            if not snapshot and set(index.hashes) != t.hashes():
                return False
    return True


@pytest.mark.parametrize("seed", range(20))
def test_tracker_to_index_over_lost_reports_ends_equal(seed):
    assert replay(seed)


def test_negative_control_an_index_that_applies_deltas_across_a_gap_drifts():
    class Trusting(PrefixIndex):
        def apply(self, d):
            self.seq = d.seq - 1  # takes every delta for the next one
            return super().apply(d)

    assert not all(replay(seed, lambda: Trusting(capacity=24)) for seed in range(20))


# ------------------------------------------------------------------------------ a gateway's copy of an index
def test_a_copy_follows_its_index_by_changes_and_by_the_whole_after_a_new_epoch(monkeypatch):
    monkeypatch.setattr(prefix_index, "LOG", 2)
    ix = PrefixIndex(capacity=4)
    ix.apply(PrefixDelta(1, (1, 2, 3)))
    u = ix.since(0, 0)  # a gateway without a copy
    assert u.full == (1, 2, 3) and u.changes == ()
    copy = PrefixIndex.copy_of(u)
    copy.follow(u)
    assert list(copy.hashes) == [1, 2, 3] and ix.since(copy.epoch, copy.version) is None
    ix.apply(PrefixDelta(2, (4, 5, 6), (2,)))  # over capacity: 1, the oldest, goes, in the copy too
    ix.apply(PrefixDelta(2))  # nothing changed: no new version
    u = ix.since(copy.epoch, copy.version)
    assert u.full is None and u.changes == (((4, 5, 6), (2,)),)
    copy.follow(u)
    copy.check_integrity()
    assert list(copy.hashes) == list(ix.hashes) == [3, 4, 5, 6]
    for seq in (3, 4, 5):  # three changes, two kept: a copy three behind gets the whole index
        ix.apply(PrefixDelta(seq, (10 + seq,)))
    assert ix.since(copy.epoch, copy.version).full == tuple(ix.hashes)
    assert ix.since(copy.epoch, ix.version - 2).changes == (((14,), ()), ((15,), ()))
    ix.apply(PrefixDelta(6, (7,), full=True))  # a snapshot: a new epoch, whatever the copy's version
    u = ix.since(copy.epoch, copy.version)
    assert u.epoch != copy.epoch and u.full == (7,)
    stale = ix.since(copy.epoch, copy.version)
    copy.follow(u)
    ix.apply(PrefixDelta(7, (8,)))
    copy.follow(stale._replace(full=None, changes=(((9,), ()),), version=copy.version + 1, epoch=123))
    assert copy.epoch == 0 and len(copy) == 0  # an update for another copy: emptied, asks for the whole again
    copy.follow(ix.since(copy.epoch, copy.version))
    assert list(copy.hashes) == list(ix.hashes) == [7, 8]
    copy.check_integrity()
    ix.check_integrity()


def follow_replay(seed: int, new_index=lambda: PrefixIndex(capacity=12)) -> bool:
    """Random deltas, gaps and snapshots on an index (as ``replay`` drives it); a copy that asks for its update now
    and then, some answers lost on the way. True when the copy, after every update it applied, held exactly the
    index's hashes in the index's order (the order decides which go first at the bound)."""
    rng = random.Random(seed)
    t, index = PrefixTracker(BS, capacity=12), new_index()
    copy: PrefixIndex | None = None
    seqs: list[list[int]] = [[rng.randrange(6) for _ in range(BS * rng.randrange(1, 5))] for _ in range(8)]
    snapshot = False
    for _ in range(150):
        if rng.random() < 0.5:
            stored(t, rng.choice(seqs))
        elif t.engine:
            t.removed([rng.choice(list(t.engine))])
        if rng.random() < 0.5:
            d = t.cut(full=snapshot)
            snapshot = rng.random() < 0.1 or not index.apply(d)  # and now and then a report lost
        if rng.random() < 0.3:
            u = index.since(*((copy.epoch, copy.version) if copy is not None else (0, 0)))
            if rng.random() < 0.3 or u is None:  # the answer lost, or nothing to follow
                continue
            copy = copy if copy is not None else PrefixIndex.copy_of(u)
            copy.follow(u)
            copy.check_integrity()
            if list(copy.hashes) != list(index.hashes):
                return False
    return True


@pytest.mark.parametrize("seed", range(20))
def test_a_copy_that_follows_now_and_then_equals_its_index(seed, monkeypatch):
    monkeypatch.setattr(prefix_index, "LOG", 3)  # copies often fall further behind than the log reaches
    assert follow_replay(seed)


def test_negative_control_an_index_that_never_sends_the_whole_leaves_its_copy_wrong(monkeypatch):
    monkeypatch.setattr(prefix_index, "LOG", 3)

    class ChangesOnly(PrefixIndex):
        def since(self, epoch, version):  # its kept changes, however far behind the copy or of another epoch
            u = super().since(epoch, version)
            return u._replace(full=None, changes=tuple(self.log)) if u is not None and u.full is not None else u

    assert not all(follow_replay(seed, lambda: ChangesOnly(capacity=12)) for seed in range(20))


# ------------------------------------------------------------------------------ the controller
def _controller(names=("a", "b")):
    import time

    from actors.report import empty_pool, unreported
    from cluster.config import parse_config
    from cluster.control.controller import Controller, ReplicaState

    ctl = Controller(parse_config({"model": "fake", "engine": {"kind": "fake"}}).model_dump())
    for n in names:
        pool = empty_pool(BS)._replace(free_blocks=40, total_blocks=64)
        ctl.replicas[n] = ReplicaState(
            n, handle=n, state="healthy", report=unreported(n)._replace(pool=pool, incarnation="i1", healthy=True),
            reported_at=time.monotonic(),
        )  # fmt: skip
    return ctl


def _report(ctl, name, delta, incarnation="i1", healthy=True):
    import asyncio

    r = ctl.replicas[name].report._replace(incarnation=incarnation, healthy=healthy, prefix=delta)
    return asyncio.run(ctl.report(name, r))


def _hits(ctl, prompt: list[int]) -> dict[str, int]:
    prefix = prefix_hashes(prompt, BS)
    return {v.name: v.prefix_blocks for v in with_prefix(ctl._views(), ctl.prefix, prefix)}


def test_the_controller_index_follows_stores_removals_restarts_gaps_and_deaths():
    from cluster.control.replica_status import ReplicaStatus

    ctl = _controller()
    prompt = list(range(16))
    h = prefix_hashes(prompt, BS)
    assert _report(ctl, "a", PrefixDelta(1, h)) is False
    assert _hits(ctl, prompt) == {"a": 4, "b": 0}
    assert _report(ctl, "a", PrefixDelta(2, (), (h[2],))) is False  # removed (vToken compacted block 2)
    assert _hits(ctl, prompt) == {"a": 2, "b": 0}
    assert _report(ctl, "a", PrefixDelta(4, (h[2],))) is True  # delta 3 lost: a snapshot, please
    assert _hits(ctl, prompt)["a"] == 0
    assert _report(ctl, "a", None) is False  # a report without a delta changes nothing
    assert _report(ctl, "a", PrefixDelta(5, h[:3], full=True)) is False
    assert _hits(ctl, prompt)["a"] == 3
    # a new engine (incarnation): what the old one held is gone; its first delta is number 1
    assert _report(ctl, "a", PrefixDelta(1, h[:1]), incarnation="i2") is False
    assert _hits(ctl, prompt)["a"] == 1
    # a restarted controller (empty indexes) hears of delta 9 of a running replica (nothing changed since): a snapshot
    ctl.prefix.clear()
    assert _report(ctl, "a", PrefixDelta(9), incarnation="i2") is True
    assert _report(ctl, "a", PrefixDelta(10, h, full=True), incarnation="i2") is False
    assert _hits(ctl, prompt)["a"] == 4
    # dies: its index goes with it, and a dead replica is no view at all
    ctl.lifecycle.transition(ctl.replicas["a"], ReplicaStatus.DEAD, "test")  # as mark_failed does
    assert "a" not in ctl.prefix and ctl.replicas["a"].state is ReplicaStatus.DEAD
    assert set(_hits(ctl, prompt)) == {"b"}
    # removed: the same
    _report(ctl, "b", PrefixDelta(1, h))
    ctl.lifecycle.remove(ctl.replicas["b"], "test")
    assert ctl.prefix == {}


def test_the_controller_places_on_the_prefix_and_never_on_a_dead_or_draining_replica():
    import asyncio

    from cluster.control.replica_status import ReplicaStatus

    ctl = _controller(("a", "b", "c"))
    asyncio.run(ctl.set_placement("prefix"))
    prompt = list(range(40))
    h = prefix_hashes(prompt, BS)
    _report(ctl, "b", PrefixDelta(1, h))
    _report(ctl, "c", PrefixDelta(1, h))

    async def place(rid):
        return (await ctl.place(rid, 2, (), 50, h))[0]

    first = asyncio.run(place("q1"))
    assert first in ("b", "c")  # the two holding it, not "a" with nothing
    ctl.replicas[first].state = ReplicaStatus.DRAINING
    other = {"b": "c", "c": "b"}[first]
    assert asyncio.run(place("q2")) == other
    ctl.replicas[other].state = ReplicaStatus.DEAD
    assert asyncio.run(place("q3")) == "a"  # the only one serving, though it holds nothing
