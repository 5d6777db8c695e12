"""tp.TensorParallel without vLLM: two processes over gloo stand in for two TP ranks. The score exchange sums
every rank's heads, the negative control does not, a rank that fails to apply a plan makes EVERY rank raise
(nobody hangs in a collective), and steps without a plan or without observed rows exchange nothing. Then
the whole scorer at TP=2: each rank holds half the heads, and what every rank folds equals one rank with all
heads (and the plain reference).

Each rank leaves the process group in order (``gloo_world``): a barrier, so that no peer is still inside a
collective, then ``destroy_process_group``, which joins gloo's threads. A rank that simply returned left
them to interpreter teardown, and about one run in five died there with SIGABRT ("terminate called without
an active exception")."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import signal
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from scores_sim import ScoreSim, assert_same_stats, batch, compare

from vtoken.core.move_batch import MoveBatch
from vtoken.kv.scores_reference import ReferenceScorer
from vtoken.vllm_adapter.faults import FaultyTensorParallel
from vtoken.vllm_adapter.messages import empty_step
from vtoken.vllm_adapter.scores import AttentionScorer
from vtoken.vllm_adapter.tp import PlanFailedError


class GlooGroup:
    """The slice of vLLM's GroupCoordinator that tp.py uses, over a plain gloo group."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist

        self.rank_in_group, self.world_size = rank, world
        self.cpu_group = self.device_group = dist.group.WORLD
        self.device_communicator = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.device_group)
        return t


@contextlib.contextmanager
def gloo_world(rank: int, world: int, init: str, save=None):
    """A gloo process group for the body, torn down in order. A gloo collective can return on one rank while
    its last message to a peer is still on the wire; a rank that exits then can take that message down with
    it, or leave gloo's threads to interpreter teardown (SIGABRT). So: a barrier (every rank is done issuing
    collectives), a rendezvous through the FILE store (every rank has returned from that barrier; no message
    is in flight anywhere), then ``destroy_process_group``, which joins gloo's threads before the process
    exits. A collective that cannot complete times out instead of hanging the test. ``save`` (if given) runs
    once the body has finished, before the teardown: the rank's result is on disk even if gloo's teardown then
    aborts the process (spawn_ranks)."""
    import torch.distributed as dist

    store = dist.FileStore(init.removeprefix("file://"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    ok = False
    try:
        yield
        ok = True
        if save is not None:
            save()
    finally:
        try:
            if ok:  # a rank that crashed must not wait for peers that may be stuck elsewhere
                dist.barrier()
                store.set(f"vtoken-exit-{rank}", "1")
                store.wait([f"vtoken-exit-{r}" for r in range(world)], timedelta(seconds=60))
        finally:
            dist.destroy_process_group()


def spawn_ranks(target, world: int = 2, *args) -> list[dict]:
    """Run ``target(rank, world, init, out, *args)`` in ``world`` spawned processes; their pickled results."""
    tmp = Path(tempfile.mkdtemp())
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=(r, world, f"file://{tmp / 'rendezvous'}", str(tmp / f"r{r}"), *args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    results = [pickle.loads(f.read_bytes()) if (f := tmp / f"r{r}").exists() else {} for r in range(world)]
    # gloo's threads can still abort a rank (SIGABRT, "terminate called without an active exception") in the
    # ordered teardown, after the rank finished its work and saved its complete result: the test's
    # harness, not the code under test. A rank that aborts before saving a complete result still fails.
    codes = [0 if c == -signal.SIGABRT and res.get("complete") else c for c, res in zip(codes, results)]
    assert codes == [0] * world, f"a rank hung or died: exit codes {codes}"
    for res in results:
        assert "crash" not in res, res.get("crash")
    return results


def _plan(n: int = 3):
    step = empty_step()
    step.moves = MoveBatch(torch.arange(n).numpy(), torch.arange(n, 2 * n).numpy())
    step.keep_blocks = {"req-7": 1}
    return step


def _rank(rank: int, world: int, init: str, out: str) -> None:
    result = {}
    try:
        with gloo_world(rank, world, init, lambda: Path(out).write_bytes(pickle.dumps(result))):
            tp = FaultyTensorParallel(GlooGroup(rank, world))
            w = torch.full((5,), float(rank + 1))
            result["sum"] = tp.sum_scores(w.clone()).tolist()
            tp.fault = "scores_rank0_only"
            result["control"] = tp.sum_scores(w.clone()).tolist()
            tp.fault = None
            with tp.applying(empty_step()):  # no plan: no collective
                pass
            with tp.applying(_plan()):  # a plan every rank applies
                pass
            result["checks_ok"] = tp.stats.check_steps
            tp.fault = "fail_rank1_moves"
            try:
                with tp.applying(_plan()):
                    pass
            except PlanFailedError as e:
                result["error"] = str(e)
            scorer = AttentionScorer(64, 16, "cpu", torch.device("cpu"), tp)
            scorer.begin_step([], [])
            scorer.end_step()  # no observed rows this step: no exchange
            result["score_steps"] = tp.stats.score_steps
            result["complete"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["crash"] = traceback.format_exc()
    finally:
        Path(out).write_bytes(pickle.dumps(result))


@pytest.mark.timeout(120)
def test_two_ranks_agree_or_both_stop():
    for r, res in enumerate(spawn_ranks(_rank)):
        assert res["sum"] == [3.0] * 5  # 1 + 2: both ranks' heads
        assert res["control"] == [float(r + 1)] * 5  # negative control: own heads only
        assert res["checks_ok"] == 1  # the empty step exchanged nothing
        assert (
            "rank(s) [1] failed to apply the compaction plan of step 3 (3 moves, requests ['req-7'])" in res["error"]
            and "injected fault" in res["error"]
        )
        assert res["score_steps"] == 1  # only the first sum_scores; not the control


# ------------------------------------------------------------------------------ the scorer at TP=2
STEPS = 7


def _scores(sim: ScoreSim, scorer) -> list:
    for i in range(STEPS):
        sim.step(evict=0.2 if i % 2 else 0.0)
    return sim.stats(scorer)


def _scores_rank(rank: int, world: int, init: str, out: str, fault: str | None) -> None:
    result = {}
    try:
        with gloo_world(rank, world, init, lambda: Path(out).write_bytes(pickle.dumps(result))):
            tp = FaultyTensorParallel(GlooGroup(rank, world), fault)
            sim = ScoreSim([], batch(), rank=rank, world=world)
            sim.scorers = [AttentionScorer(sim.kv[0].shape[0] * sim.bs, sim.bs, "cpu", torch.device("cpu"), tp)]
            result["heads"] = (sim.kv[0].shape[1], sim.q_heads)
            result["stats"] = _scores(sim, sim.scorers[0])
            result["exchanges"] = tp.stats.score_steps
            result["complete"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        result["crash"] = traceback.format_exc()
    finally:
        Path(out).write_bytes(pickle.dumps(result))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", [None, "scores_rank0_only"])
def test_scorer_at_two_ranks_equals_one_rank_with_all_heads(fault):
    """Each rank folds the all-reduced weights of both ranks' heads: the same statistics as one rank holding
    every head. Negative control: without the exchange (``scores_rank0_only``) every rank differs."""
    one = ScoreSim([], batch())
    num_slots = one.kv[0].shape[0] * one.bs
    one.scorers = [
        AttentionScorer(num_slots, one.bs, "cpu", torch.device("cpu")),
        ReferenceScorer(num_slots, one.bs, "cpu"),
    ]
    single = _scores(one, one.scorers[0])
    assert_same_stats(one, *one.scorers)
    ranks = spawn_ranks(_scores_rank, 2, fault)
    assert [r["heads"][0] for r in ranks] == [1, 1]  # each rank holds one of the two KV heads
    assert all(r["exchanges"] == (0 if fault else STEPS) for r in ranks)  # one all-reduce per observed step
    ref = one.stats(one.scorers[1], ("attn_sum", "attn_hist", "near_tie"))
    for res in ranks:
        if fault is None:
            compare(one.reqs, res["stats"], ref)
            for a, b in zip(res["stats"], single):
                np.testing.assert_allclose(a["attn_sum"], b["attn_sum"], rtol=1e-5, atol=1e-6)
        else:
            with pytest.raises(AssertionError):
                compare(one.reqs, res["stats"], ref)
