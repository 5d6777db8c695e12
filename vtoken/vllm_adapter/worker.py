"""Worker classes vLLM loads by name (``ParallelConfig.worker_cls``) when vToken is on."""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.vllm_adapter.model_runner import runner_cls


class VTokenWorkerRPC:
    """Methods reached through ``LLM.collective_rpc(name)`` on every worker (tensor-parallel ranks)."""

    def vtoken_tp_stats(self) -> dict:
        """This rank's cost of the cross-rank exchanges (see tp.ExchangeStats)."""
        tp = self.model_runner.vt_tp
        return {"rank": tp.rank, "world": tp.world, "backend": tp.backend, **tp.stats.summary()}

    def vtoken_score_counts(self) -> dict:
        """What this rank's scorers did since the engine started: forwards and rows the per-step scorer scored
        (``decode_rows``: decode queries among them; prompt chunks' windows are the rest), windows of recent
        queries scored on demand, parked bytes read to score recalls, and (VTOKEN_RECALL_AUDIT=1) how often the
        summaries' candidates held the exact path's top parked tokens."""
        runner = self.model_runner
        scorer = runner.vt_scorer
        counts = dict(scorer.counts) if scorer is not None else {"steps": 0, "rows": 0}
        tier = runner.vt_tier
        return {
            **counts,
            "decode_rows": runner.vt_decode_scored,
            "windows": runner.vt_window_scored,
            "bytes_recalled": tier.bytes_recalled if tier is not None else 0,
            "recall_audit": dict(runner.vt_recall_audit) if runner.vt_recall_audit is not None else None,
        }

    def vtoken_tp_probe(self, numel: int, reps: int = 200) -> dict:
        """Latency of the exchanges alone, ranks in step (see tp.TensorParallel.probe); every rank runs it."""
        return {"rank": self.model_runner.vt_tp.rank, **self.model_runner.vt_tp.probe(numel, reps)}


def _force_v1_runner(worker) -> None:
    """vToken's overrides mirror the V1 runner (_prepare_inputs, _update_states); the V2 runner differs. vLLM
    reads ``VllmConfig.use_v2_model_runner`` once, in the worker's __init__ (vllm/v1/worker/gpu_worker.py
    Worker.__init__), so setting the worker's copy picks V1 without touching anyone's environment."""
    worker.use_v2_model_runner = False


class VTokenCPUWorker(VTokenWorkerRPC, CPUWorker):
    """Mirror of vllm/v1/worker/cpu_worker.py CPUWorker.init_device, which builds its CPUModelRunner inline:
    we let it, then replace the (not yet loaded) runner with vToken's subclass."""

    runner_mixins: tuple[type, ...] = ()  # the testing worker adds its negative controls here

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _force_v1_runner(self)

    def init_device(self) -> None:
        super().init_device()
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        self.model_runner = runner_cls(CPUModelRunner, *self.runner_mixins)(self.vllm_config, torch.device("cpu"))


def gpu_worker_cls(*mixins: type, rpc: tuple[type, ...] = ()):
    """vToken's CUDA worker (its runner with ``mixins`` first, extra RPC classes in ``rpc``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class VTokenGPUWorker(*rpc, VTokenWorkerRPC, Worker):
        """Mirror of vllm/v1/worker/gpu_worker.py Worker._make_model_runner (meant for subclasses)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            _force_v1_runner(self)

        def _make_model_runner(self, *args, **kwargs):
            return runner_cls(GPUModelRunner, *mixins)(self.vllm_config, self.device)

    return VTokenGPUWorker


def __getattr__(name: str):
    if name == "VTokenGPUWorker":  # imported lazily: the CPU build of vLLM has no CUDA worker deps
        return gpu_worker_cls()
    raise AttributeError(name)
