"""tp.TensorParallel without vLLM: two processes over gloo stand in for two TP ranks. The score exchange sums
every rank's heads, the negative control does not, a rank that fails to apply a plan makes EVERY rank raise
(nobody hangs in a collective), and steps without a plan or without decode slots exchange nothing."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from vtoken.mover import MoveBatch
from vtoken.vllm_adapter.messages import empty_step
from vtoken.vllm_adapter.scores import AttentionScorer
from vtoken.vllm_adapter.tp import PlanFailedError, TensorParallel


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


def _plan(n: int = 3):
    step = empty_step()
    step.moves = MoveBatch(torch.arange(n).numpy(), torch.arange(n, 2 * n).numpy())
    step.keep_blocks = {"req-7": 1}
    return step


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    result = {}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        tp = TensorParallel(GlooGroup(rank, world))
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
        scorer.end_step()  # no decode slots this step: no exchange
        result["score_steps"] = tp.stats.score_steps
    except Exception:  # noqa: BLE001 - reported to the test
        result["crash"] = traceback.format_exc()
    finally:
        Path(out).write_text(repr(result))


@pytest.mark.timeout(120)
def test_two_ranks_agree_or_both_stop():
    world = 2
    tmp = Path(tempfile.mkdtemp())
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, world, f"file://{tmp / 'rendezvous'}", str(tmp / f"r{r}")))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode == 0, "a rank hung or died"
    results = [eval((tmp / f"r{r}").read_text()) for r in range(world)]  # noqa: S307 - our own repr
    for r, res in enumerate(results):
        assert "crash" not in res, res.get("crash")
        assert res["sum"] == [3.0] * 5  # 1 + 2: both ranks' heads
        assert res["control"] == [float(r + 1)] * 5  # negative control: own heads only
        assert res["checks_ok"] == 1  # the empty step exchanged nothing
        assert (
            "rank(s) [1] failed to apply the compaction plan of step 3 (3 moves, requests ['req-7'])" in res["error"]
            and "injected fault" in res["error"]
        )
        assert res["score_steps"] == 1  # only the first sum_scores; not the control
