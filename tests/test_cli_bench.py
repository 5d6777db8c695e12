"""The `vtoken` command: argument errors, models list, and the benchmarks' --quick smoke runs (structure only)."""

import json
import subprocess
import sys

import pytest

from vtoken.bench.overhead import QUICK_MODES as QUICK_OVERHEAD_MODES

VTOKEN = [sys.executable, "-m", "vtoken.cli"]


def vt(*args, **kw):
    return subprocess.run(VTOKEN + list(args), capture_output=True, text=True, timeout=900, **kw)


def test_models_list_shows_prepared_models():
    r = vt("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    names = {m["name"]: m for m in json.loads(r.stdout)}
    assert names["tiny-llama"]["prepared"] and names["smollm2-135m"]["prepared"]


def test_demo_rejects_bad_arguments_clearly():
    r = vt("demo", "--policy", "lru")
    assert r.returncode == 2 and "unknown eviction policy" in r.stderr
    r = vt("demo", "--modes", "off,fast")
    assert r.returncode == 2 and "--modes" in r.stderr


def test_vllm_args_prints_the_flags_engine_kwargs_adds_and_refuses_a_bad_config():
    import shlex

    from vtoken.vllm_adapter.engine import engine_kwargs

    r = vt("vllm-args", '{"policy": "streaming", "budget": 0.25, "prefill_chunk": 128}')
    assert r.returncode == 0, r.stderr
    flags = shlex.split(r.stdout)
    kw = engine_kwargs({"policy": "streaming", "budget": 0.25, "prefill_chunk": 128})
    assert flags[flags.index("--scheduler-cls") + 1] == kw["scheduler_cls"]
    assert flags[flags.index("--worker-cls") + 1] == kw["worker_cls"]
    assert json.loads(flags[flags.index("--additional-config") + 1]) == kw["additional_config"]
    assert "--no-async-scheduling" in flags and flags[flags.index("--long-prefill-token-threshold") + 1] == "128"
    r = vt("vllm-args", "{}")  # VTokenConfig's defaults, not vToken off: the flags of mode vtoken
    assert r.returncode == 0, r.stderr
    flags = shlex.split(r.stdout)
    assert json.loads(flags[flags.index("--additional-config") + 1])["vtoken"]["mode"] == "vtoken"
    r = vt("vllm-args", '{"budget": -1}')
    assert r.returncode == 2 and "budget: must be > 0, got -1.0" in r.stderr and "Traceback" not in r.stderr


def test_bench_core_quick(tmp_path):
    r = vt("bench", "core", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "core.json").read_text())
    assert out["table"]["bytes_per_token"] <= 8
    assert out["planner"]["moves"] == out["planner"]["lower_bound"]
    assert out["mover"]["gbps"] > 0 and {"machine", "settings", "seconds"} <= set(out)


# Structure, not numbers: each benchmark's --quick form on the tiny model writes JSON, Markdown and a plot.
QUICK = {
    "blocks": lambda o: (
        {"summary", "rows", "reduction_range"} <= set(o)
        and {s["policy"] for s in o["summary"]} == {"h2o", "scissorhands", "random", "streaming"}
        and o["naive_engine_same_decisions"]
    ),
    "concurrency": lambda o: (
        [r["mode"] for r in o["results"]][:1] == ["off"] and all(r["max_concurrency"] >= 1 for r in o["results"])
    ),
    "sla": lambda o: set(o["modes"]) == {"off", "naive", "vtoken"} and o["sla"]["ttft"] > 0,
    "overhead": lambda o: (
        [r["mode"] for r in o["rows"]] == list(QUICK_OVERHEAD_MODES) and all(r["ms_per_step"] > 0 for r in o["rows"])
    ),
    "quality": lambda o: (
        {"full", "h2o@0.25", "h2o@0.25 every 2"} <= set(o["perplexity"]) and o["passkey"]["naive_equals_vtoken"]
    ),
    "retrieval": lambda o: (
        {"full KV", "snapkv@0.25:always", "snapkv@0.25:park", "snapkv@0.25:pressure", "random@0.25:always"}
        <= set(o["configs"])
        and all(0 <= c["hits"] <= o["prompts"] for c in o["configs"].values())
        and set(o["saturated"]) == {"snapkv@0.25:pressure"}
    ),
    "keyscores": lambda o: (
        set(o["configs"]) == {"full KV", "window", "knorm", "keydiff", "streaming"}
        and all(0 <= c["hits"] <= c["n"] == o["prompts"] and 0 < c["live_share"] <= 1 for c in o["configs"].values())
        and o["configs"]["full KV"]["live_share"] == 1
    ),
    "footprint": lambda o: all(r["lines"] < 30 for r in o["policies"]) and o["metadata"]["bytes_per_token"] <= 8,
    # The simulator needs no engine: the committed calibration, a few replicas, a compressed day.
    "fleet": lambda o: (
        set(o["validation"]["goodput"]) == {"free_blocks", "round_robin"}
        and {"naive+round_robin", "vtoken+round_robin", "vtoken+free_blocks"} <= set(o["sweep"]["results"])
        and all(r["replicas"] >= 1 for r in o["needed"]["results"].values())
        and any(k.endswith("+autoscaler") for k in o["day"]["results"])
        and all(0 <= r["attainment"] <= 1 and r["replica_hours"] > 0 for r in o["day"]["results"].values())
        and {"replica_hours_target_met", "goodput_target_met"} <= set(o["targets"])
        and set(o["bursts"]["results"]) == set(o["sweep"]["results"])
        and o["capacity_scale"]["replicas"] == o["needed"]["scale"]
        and set(o["capacity_scale"]["results"]) == set(o["sweep"]["results"])
        and {r["strategy"] for r in o["chat"]["rows"]} == {"round_robin", "weighted", "prefix", "prefix_oracle"}
        and all(0 <= r["hit_rate"] <= 1 for r in o["chat"]["rows"])
        and o["targets"]["chat_prefix_vs_weighted"]
    ),
    # The simulator's conversation study alone: both workloads, every placement, prefix against weighted.
    "fleet_chat": lambda o: (
        set(o["workloads"]) == {"cached", "long"}
        and all(
            {r["strategy"] for r in w["rows"]} == {"round_robin", "weighted", "prefix", "prefix_oracle"}
            for w in o["workloads"].values()
        )
        and all(w["prefix_vs_weighted"] for w in o["workloads"].values())
    ),
}


@pytest.mark.parametrize("name", list(QUICK))
def test_bench_quick(name, tmp_path):
    """In this process: offline engines start in seconds (VLLM_ENABLE_V1_MULTIPROCESSING=0, conftest)."""
    if name not in ("footprint", "fleet", "fleet_chat"):
        pytest.importorskip("vllm")
    from vtoken.cli import main

    assert main(["bench", name, "--quick", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / f"{name}.json").read_text())
    assert {"benchmark", "command", "settings", "machine", "seconds"} <= set(out)
    assert QUICK[name](out), f"{name}: unexpected structure"
    assert (tmp_path / f"{name}.md").read_text().count("|") > 8
    assert (tmp_path / f"{name}.png").stat().st_size > 5000


def test_every_suite_builds_its_prompts_at_its_quick_lengths():
    """What --quick runs of each suite starts from: its cases at the quick lengths and depths, with answers, and the
    role the tables print (niah alone is tuned on). The engine path is the same for every suite and runs in
    test_bench_quick[retrieval] (an engine run per suite here cost CI 30-40 s each)."""
    from transformers import AutoTokenizer

    from vtoken.bench.suites import SUITES
    from vtoken.models import model_path

    tok = AutoTokenizer.from_pretrained(str(model_path("tiny-llama")))
    for name, suite in SUITES.items():
        cases = suite.build(tok, [256 if name == "niah" else 384], 2 if name == "niah" else 3)
        assert len(cases) >= 2 and all(c.prompt and c.answer is not None for c in cases), name
        assert suite.tuning == (name == "niah") and suite.role


def test_bench_goodput_plumbing_on_the_fake_engine(tmp_path):
    """The serving benchmark end to end (embedded Ray, two replicas, controller, gateway; JSON, Markdown, plot
    and the machine's load) on the fake engine, in well under a minute. Its --quick form on tiny-llama starts
    two vLLM replicas (minutes on this machine), so it is not part of the smoke runs."""
    from vtoken.cli import main

    assert main(["bench", "goodput", "--quick", "--engine", "fake", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "goodput.json").read_text())
    assert {"benchmark", "command", "settings", "machine", "seconds"} <= set(out)
    assert set(out["goodput"]) == {"free_blocks", "round_robin"} and out["requests"] == 6
    assert out["load"]["cpus"] >= 1 and len(out["load"]["loadavg_before"]) == len(out["load"]["loadavg_after"]) == 3
    assert all(sum(r["heavy_per_replica"].values()) == 3 for runs in out["runs"].values() for r in runs)
    assert set(out["deadline_sweep_s"]) == {"2", "2.25", "2.5", "3"}
    for r in (r for runs in out["runs"].values() for r in runs):
        counts = [r["completed_within"][k] for k in ("2", "2.25", "2.5", "3")]  # a longer deadline never counts fewer
        assert counts == sorted(counts) and r["completed_within"]["2.5"] == r["completed_within_deadline"]
    assert "load average" in (tmp_path / "goodput.md").read_text()
    assert "rounds won / tied / lost" in (tmp_path / "goodput.md").read_text()
    assert (tmp_path / "goodput.png").stat().st_size > 5000


def test_bench_chat_plumbing_on_the_fake_engine(tmp_path):
    """The chat benchmark end to end on the fake engine (embedded Ray, the OpenAI door, three servers, /metrics'
    prefix counters): its structure, in well under a minute. Its --quick form on tiny-llama starts three vLLM servers
    (about two minutes on this machine), so it is not part of the smoke runs."""
    from vtoken.cli import main

    assert main(["bench", "chat", "--quick", "--engine", "fake", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "chat.json").read_text())
    assert {"benchmark", "command", "settings", "machine", "seconds", "load"} <= set(out)
    assert set(out["placement"]) == {"round_robin", "weighted", "prefix"}
    turns = {r["turns"] for r in out["placement"].values()} | {out["single"][m]["turns"] for m in ("vtoken", "off")}
    assert len(turns) == 1 and out["short_pool"]["turns"] in turns  # the same shapes in every run
    for r in [*out["placement"].values(), out["single"]["vtoken"], out["single"]["off"], out["short_pool"]]:
        assert r["ttft"]["p50_s"] > 0 and 0 < r["hit_rate"] <= 1 and r["tokens_per_s"] > 0
    assert out["single"]["replies_agree"]["equal"] == 1.0  # the fake answers alike in every mode
    assert 0 <= out["short_pool"]["replies_vs_full_kv"]["equal"] <= 1
    assert "short pool" in (tmp_path / "chat.md").read_text() and (tmp_path / "chat.png").stat().st_size > 5000


def test_bench_chat_runs_only_the_parts_asked(tmp_path):
    """``--parts placement``: one server, the strategies asked, no single or short-pool run, and the page without
    their tables; part 3 alone is refused (it compares with part 2's stock replies)."""
    from vtoken.cli import main

    args = ["bench", "chat", "--quick", "--engine", "fake", "--out", str(tmp_path), "--max-model-len", "3072"]
    assert main([*args, "--parts", "placement", "--strategies", "weighted,prefix"]) == 0
    out = json.loads((tmp_path / "chat.json").read_text())
    assert set(out["placement"]) == {"weighted", "prefix"} and out["parts"] == ["placement"]
    assert "single" not in out and "short_pool" not in out and out["workload"]["max_model_len"] == 3072
    md = (tmp_path / "chat.md").read_text()
    assert "Placement on 2 replicas" in md and "One replica" not in md and "short pool" not in md
    with pytest.raises(SystemExit, match="run single too"):
        main([*args, "--parts", "short"])


def test_rounds_against_round_robin_counts_each_round_at_each_deadline():
    """Hand-made runs: a round where round_robin's late requests end inside the deadline is a tie, not a win;
    a longer deadline from the sweep turns the lost round into a tie."""
    from vtoken.bench.goodput import rounds_against, sweep_table

    def run(primary: int, by: dict[str, int]) -> dict:
        return {"completed_within_deadline": primary, "completed_within": by}

    result = {
        "heavy_alone_s": 2.0,
        "deadline_sweep_s": {"2": 4.0, "3": 6.0},
        "runs": {
            "weighted": [run(12, {"2": 12, "3": 12}), run(12, {"2": 11, "3": 12}), run(10, {"2": 9, "3": 12})],
            "round_robin": [run(9, {"2": 9, "3": 12}), run(12, {"2": 9, "3": 12}), run(11, {"2": 9, "3": 12})],
        },
    }
    assert rounds_against(result) == {"weighted": [1, 1, 1]}
    assert rounds_against(result, "2") == {"weighted": [2, 1, 0]}
    assert rounds_against(result, "3") == {"weighted": [0, 3, 0]}
    (table,) = sweep_table(result)
    assert table.rows == [
        ["2 x (4.0 s)", "12, 11, 9", "9, 9, 9", "2 / 1 / 0"],
        ["3 x (6.0 s)", "12, 12, 12", "12, 12, 12", "0 / 3 / 0"],
    ]


def test_serve_rounds_interval_is_students_t_on_the_log_ratios():
    """`bench serve`'s interval over rounds: equal ratios give a point; [1, 1.1, 0.9, 1.05] against the same
    arithmetic written out (t(3) = 3.182); fewer than three rounds give none."""
    import math
    import statistics

    from vtoken.bench.serve import geomean_interval

    assert geomean_interval([1.02] * 5) == pytest.approx([1.02] * 3)
    logs = [math.log(x) for x in (1.0, 1.1, 0.9, 1.05)]
    m, half = statistics.fmean(logs), 3.182 * statistics.stdev(logs) / 2
    assert geomean_interval([1.0, 1.1, 0.9, 1.05]) == pytest.approx(
        [math.exp(m), math.exp(m - half), math.exp(m + half)]
    )
    assert geomean_interval([1.0, 1.1]) is None


def test_doorcost_summary_pairs_each_round():
    """`bench doorcost`'s summary: medians per tree, and each round's ratio of the two trees (not the ratio of the
    medians) with its interval. Three rounds whose ratios are all 1.1 give 1.1 by round although the medians' ratio
    is 1.0 (the trees' speeds cross between rounds); two rounds give no interval."""
    from vtoken.bench.doorcost import summary, tables

    def rnd(this, against):
        cpu = {"gateway_and_client_ms": 1.0, "total_ms": 10.0, "tpot_median_ms": 8.0}
        streams = {k: v for k, v in zip(("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"),
                                        (this, 2 * this, 10.0, 20.0))}  # fmt: skip
        other = {**streams, "median_ttft_ms": against, "p99_ttft_ms": 2 * against}
        return {"this": {"cpu": cpu, "streams": {"16": streams}}, "against": {"cpu": cpu, "streams": {"16": other}}}

    rounds = [rnd(110.0, 100.0), rnd(220.0, 200.0), rnd(165.0, 150.0)]
    s = summary(rounds, [16])
    ttft = s["c16.median_ttft_ms"]
    assert (ttft["this"], ttft["against"]) == (165.0, 150.0) and ttft["ratio"] == pytest.approx(1.1)
    assert ttft["round_ratios"] == [1.1, 1.1, 1.1] and ttft["geomean_ci95"] == pytest.approx([1.1] * 3)
    rounds[1] = rnd(100.0, 200.0)  # this tree twice as fast in one round: the interval widens
    s = summary(rounds, [16])
    lo, hi = s["c16.median_ttft_ms"]["geomean_ci95"][1:]
    assert lo < 0.5 and hi > 1.1
    assert summary(rounds[:2], [16])["c16.median_ttft_ms"]["geomean_ci95"] is None
    trees = {"this": {"commit": "a", "subject": ""}, "against": {"commit": "b", "subject": ""}}
    load = {"loadavg_before": 0, "loadavg_after": 0, "cpus": 2}
    table = tables({"trees": trees, "model": "m", "rounds": rounds, "summary": s, "load": load})[0]
    row = next(r for r in table.rows if r[0] == "c16.median_ttft_ms")
    g, lo, hi = s["c16.median_ttft_ms"]["geomean_ci95"]
    assert row[-1] == f"{g:.3f} [{lo:.3f}, {hi:.3f}]"
