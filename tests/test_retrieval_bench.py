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

    def fake_serve(e, cases, configs, args, floors=None):
        e.served += [retrieval.label(*c) for c in configs]
        rec = {"mean_retained_blocks": 1, "peak_retained_blocks": 1, "mean_naive_retained_blocks": 1,
               "peak_naive_retained_blocks": 1, "peak_over_bound": 0}  # fmt: skip
        return {
            retrieval.label(*c): {
                "texts": ["x"],
                "records": [rec],
                "preempted": 0,
                "queued": 0,
                "most_in_flight": 1,
                "engine": {},
            }
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


def test_request_floor_asks_every_other_prompt_in_pressure_runs_and_scores_each_half(monkeypatch):
    """``--request-floor F``: in a saturated pressure run the even prompts carry ``pressure_floor: F`` in their own
    options (the rest none: the engine's), an ``always`` run carries none, and each half is scored on its own beside
    the whole run."""
    sent = []

    class FakeEngine:
        def __init__(self, folder, mode, cfg, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def batch(self, prompts, max_tokens, opts):
            sent.append(opts)
            rec = {"mean_retained_blocks": 1, "peak_retained_blocks": 1, "mean_naive_retained_blocks": 1,
                   "peak_naive_retained_blocks": 1, "peak_over_bound": 0}  # fmt: skip
            served = [SimpleNamespace(last_token_ts=1.0, scheduled_ts=0.0, output_tokens=[], record=rec,
                                      preemptions=0) for _ in prompts]  # fmt: skip
            return SimpleNamespace(served=served, seconds=1.0, output_tokens=0, engine={"recalls": 2})

    answers = iter(["7", "0", "7", "7"] * 2)
    monkeypatch.setattr(retrieval, "Engine", FakeEngine)
    monkeypatch.setattr(retrieval, "reply", lambda tok, ids, chat: next(answers))
    args = SimpleNamespace(saturate="snapkv@0.25:pressure,snapkv@0.25:always", saturate_kv_bytes=1 << 20,
                           prefill_chunk=64, park_tokens=4096, suite="niah", pressure_floor=0.0, request_floor=0.5,
                           window=32, max_tokens=8)  # fmt: skip
    cases = [SimpleNamespace(answer="7", task="single", length=256, prompt="p") for _ in range(4)]
    out = retrieval._saturated(args, "folder", None, cases, {"kv_bytes": 1 << 30})
    pressure = [o.get("pressure_floor") for o in sent[1]]  # the tiered engine serves pressure (after always)
    assert pressure == [0.5, None, 0.5, None]
    assert all("pressure_floor" not in o for o in sent[0]), "always mode asks no floor"
    assert [out[k]["hits"] for k in ("snapkv@0.25:pressure", "snapkv@0.25:pressure, asks 0.5",
                                     "snapkv@0.25:pressure, the rest")] == [3, 2, 1]  # fmt: skip
    assert "snapkv@0.25:always, asks 0.5" not in out
    assert out["snapkv@0.25:pressure"]["recall"]["recalls"] == 2, "what recall did in the run is reported"
