"""Where the per-layer waits sit (vtoken/vllm_adapter/move_waits.py), when the runner waits for every move, and
what vToken asks of vLLM's CUDA graphs (engine_kwargs): all on CPU, with stand-ins for vLLM's layers."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from vtoken.config import VTokenConfig  # noqa: E402
from vtoken.kv import mover as mover_mod  # noqa: E402
from vtoken.kv.fused_mover import FusedMover  # noqa: E402
from vtoken.kv.mover import CpuMover  # noqa: E402
from vtoken.vllm_adapter import engine as engine_mod  # noqa: E402
from vtoken.vllm_adapter import move_waits  # noqa: E402
from vtoken.vllm_adapter.model_runner import VTokenRunnerMixin  # noqa: E402

BS = 4


class RecordingMover(FusedMover):
    def __init__(self, log):
        super().__init__(BS, "flash", "cpu")
        self.log = log

    def wait_layer(self, layer, stream=None):
        self.log.append(("wait", layer))


class FakeImpl:
    """Stands in for a vLLM attention impl: the two methods the hooks wrap, recording their calls."""

    def __init__(self, log, i):
        self.log, self.i = log, i

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.log.append(("write", self.i))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, **kw):
        self.log.append(("attend", self.i))


def test_each_layer_waits_for_its_own_moves_before_it_writes_or_reads_its_cache():
    log = []
    kv = [torch.zeros(6, 2, BS, 8) for _ in range(5)]
    layers = {f"model.layers.{i}.attn": SimpleNamespace(impl=FakeImpl(log, i), kv_cache=kv[i]) for i in range(5)}
    layers["stray"] = SimpleNamespace(impl=FakeImpl(log, 99), kv_cache=torch.zeros(6, 2, BS, 8))  # not a bound cache
    mover = RecordingMover(log)
    assert move_waits.install(layers, mover, kv, []) == 5
    assert move_waits.install(layers, mover, kv, []) == 0  # never wrapped twice
    for i in (0, 3):
        impl = layers[f"model.layers.{i}.attn"].impl
        impl.do_kv_cache_update(None, None, None, kv[i], None)
        impl.forward(None, None, None, None, kv[i], None)
    assert log == [("wait", 0), ("write", 0), ("wait", 0), ("attend", 0), ("wait", 3), ("write", 3)] + [
        ("wait", 3),
        ("attend", 3),
    ]
    assert mover.hooked == set(range(5)) and mover.unhooked_events() == [0]  # before the forward: statistics only


def test_a_layer_without_its_hook_is_waited_for_before_the_forward():
    kv = [torch.zeros(6, 2, BS, 8) for _ in range(5)]
    layers = {i: SimpleNamespace(impl=FakeImpl([], i), kv_cache=kv[i]) for i in (0, 1, 2, 4)}  # layer 3 unhooked
    mover = RecordingMover([])
    move_waits.install(layers, mover, kv, [])
    assert mover.layer_event == [1, 2, 2, 3, 3] and mover.unhooked_events() == [0, 3]
    assert move_waits.install(layers, CpuMover(BS, "flash"), kv, []) == 0  # CPU: moves finish before the forward


def test_the_runner_waits_for_everything_when_vllm_writes_blocks_first():
    calls = []
    runner = SimpleNamespace(
        vt_mover=SimpleNamespace(wait=lambda: calls.append("all"), wait_unhooked=lambda: calls.append("unhooked"))
    )
    VTokenRunnerMixin._vt_order_moves(runner, SimpleNamespace(new_block_ids_to_zero=None, kv_cache_block_copies=None))
    VTokenRunnerMixin._vt_order_moves(runner, SimpleNamespace(new_block_ids_to_zero=[3], kv_cache_block_copies=None))
    VTokenRunnerMixin._vt_order_moves(
        runner, SimpleNamespace(new_block_ids_to_zero=None, kv_cache_block_copies=[(1, 2)])
    )
    assert calls == ["unhooked", "all", "all"]
    VTokenRunnerMixin._vt_order_moves(SimpleNamespace(vt_mover=CpuMover(BS)), SimpleNamespace())  # CPU: nothing


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(engine_mod, "_platform", lambda: "cuda")
    monkeypatch.setattr(mover_mod, "graph_safe_events", lambda: True)


def test_cuda_keeps_graphs_full_without_a_scorer_and_piecewise_with_one(on_cuda):
    kw = engine_mod.engine_kwargs(VTokenConfig(policy="streaming"), block_size=16)
    assert "enforce_eager" not in kw and "compilation_config" not in kw  # vLLM's default: full and piecewise
    kw = engine_mod.engine_kwargs(VTokenConfig(policy="h2o"), block_size=16)
    assert "enforce_eager" not in kw and kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    kw = engine_mod.engine_kwargs(VTokenConfig(policy="random", collect_scores=True), compilation_config={"mode": 3})
    assert kw["compilation_config"] == {"mode": 3, "cudagraph_mode": "PIECEWISE"}
    assert engine_mod.engine_kwargs(VTokenConfig(policy="h2o"), enforce_eager=True)["enforce_eager"] is True
    with pytest.raises(ValueError, match="piecewise CUDA graphs"):
        engine_mod.engine_kwargs(VTokenConfig(policy="h2o"), compilation_config={"cudagraph_mode": "FULL"})


def test_cuda_without_external_events_keeps_graphs_piecewise(on_cuda, monkeypatch):
    monkeypatch.setattr(mover_mod, "graph_safe_events", lambda: False)
    kw = engine_mod.engine_kwargs(VTokenConfig(policy="streaming"))
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}


def test_cpu_still_runs_eagerly():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        pytest.skip("a CUDA build of vLLM")
    assert engine_mod.engine_kwargs(VTokenConfig(policy="h2o"), block_size=16)["enforce_eager"] is True


def test_the_scorer_hook_refuses_to_be_captured_into_a_cuda_graph(monkeypatch):
    """A full graph would replay attention without the scorer's hook: capturing it fails loudly instead."""
    from vtoken.vllm_adapter import scores

    log = []
    impl = FakeImpl(log, 0)
    scores.install({"layer": SimpleNamespace(impl=impl)}, scorer=None)
    cuda_query = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="PIECEWISE"):
        impl.forward(None, cuda_query, None, None, None, None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    impl.forward(None, cuda_query, None, None, None, None)  # eager, between captured pieces: runs
    assert log == [("attend", 0)]
