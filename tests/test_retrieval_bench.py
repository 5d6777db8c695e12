"""vtoken bench retrieval's bookkeeping, without an engine: which engine each configuration is served by."""

from __future__ import annotations

from types import SimpleNamespace

from vtoken.bench import retrieval


def test_saturated_tier_only_for_park_and_pressure(monkeypatch):
    """A saturated ``always`` configuration runs without the parking tier (what its label says: a dropped token
    is lost); park and pressure run with it. The compactor parks whenever a tier exists, so an ``always`` served
    by a tiered engine would report parking's accuracy under always's name."""
    engines = []

    class FakeEngine:
        def __init__(self, folder, mode, cfg, **kw):
            self.cfg, self.served = cfg, []
            engines.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def fake_serve(e, cases, configs, args):
        e.served += [retrieval.label(*c) for c in configs]
        rec = {"mean_retained_blocks": 1, "peak_retained_blocks": 1, "mean_naive_retained_blocks": 1,
               "peak_naive_retained_blocks": 1, "peak_over_bound": 0}  # fmt: skip
        return {
            retrieval.label(*c): {"texts": ["x"], "records": [rec], "preempted": 0, "queued": 0, "most_in_flight": 1}
            for c in configs
        }

    monkeypatch.setattr(retrieval, "Engine", FakeEngine)
    monkeypatch.setattr(retrieval, "_serve", fake_serve)
    args = SimpleNamespace(saturate="snapkv@0.25:always,snapkv@0.25:pressure,h2o@0.25:park",
                           saturate_kv_bytes=1 << 20, prefill_chunk=64, park_tokens=4096, suite="niah",
                           pressure_floor=0.5)  # fmt: skip
    cases = [SimpleNamespace(answer="1", task="single", length=256)]
    out = retrieval._saturated(args, "folder", None, cases, {"kv_bytes": 1 << 30})
    assert set(out) == {"snapkv@0.25:always", "snapkv@0.25:pressure", "h2o@0.25:park"}
    tiers = {name: e.cfg.get("park_tokens", "auto") != 0 for e in engines for name in e.served}  # auto: a tier
    assert tiers == {"snapkv@0.25:always": False, "snapkv@0.25:pressure": True, "h2o@0.25:park": True}
    assert {e.cfg["pressure_floor"] for e in engines} == {0.5}, "--pressure-floor reaches every engine"
