"""`vtoken bench frontier`'s arithmetic and page, on a hand-made result (no engine, no server): the pooled share of
answers kept (held-out suites only), served-correct goodput and its ratios, the Markdown table, a configuration
that failed to start shown as an error, and the plot."""

from __future__ import annotations

import pytest

from vtoken.bench import frontier
from vtoken.bench.needles import wilson
from vtoken.bench.report import markdown


def _answers(**hits_n) -> dict:
    out = {}
    for suite, (hits, n) in hits_n.items():
        lo, hi = wilson(hits, n)
        out[suite] = {"hits": hits, "n": n, "share": hits / n, "ci95": [lo, hi]}
    return out


def _config(name: str, rps: float | None, answers: dict, error: str | None = None) -> dict:
    c = frontier.CONFIGS[name]
    tp = (
        {"decode": {"error": error}, "prefill": {"error": error}}
        if error
        else {
            "decode": {"request_throughput": rps, "median_ttft_ms": 900.0, "median_tpot_ms": 41.5},
            "prefill": {"request_throughput": rps / 2, "median_ttft_ms": 3100.0, "median_tpot_ms": 60.0},
        }
    )
    kept = frontier.pooled(answers)
    return {
        "settings": {**c._asdict(), "vtoken": {"pressure_floor": 0.5 if c.floor else 0.0}},
        "throughput": tp,
        "answers": answers,
        "kept": kept,
        "goodput": frontier.goodput(None if error else rps, kept),
        "errors": {part: r["error"] for part, r in {**tp, **answers}.items() if "error" in r},
    }


def _result() -> dict:
    refused = "ValueError: vToken mode 'vtoken' cannot run with kv_cache_dtype='fp8'"
    fp8 = _answers(niah=(18, 24), multi=(8, 20), agree=(15, 20), longreply=(7, 10))
    configs = {
        "stock": _config("stock", 0.20, _answers(niah=(20, 24), multi=(10, 20), agree=(20, 20), longreply=(10, 10))),
        "stock-fp8": _config("stock-fp8", 0.4, fp8),
        "vtoken-0.25-floor": _config(
            "vtoken-0.25-floor", 0.50, _answers(niah=(12, 24), multi=(6, 20), agree=(10, 20), longreply=(4, 10))
        ),
        "vtoken-fp8-0.5": _config(
            "vtoken-fp8-0.5", None, {s: {"error": refused} for s in ("niah", "multi", "agree", "longreply")}, refused
        ),
    }  # fmt: skip
    frontier.ratios(configs)
    suites = {
        s: {"split": "tuning" if s == "niah" else "held-out", "n": 20} for s in ("niah", "multi", "agree", "longreply")
    }
    return {
        "model": "smollm2-135m",
        "pool_bytes": 128 << 20,
        "kv_bytes_per_token": {"auto": 46080, "fp8": 11520},
        "workloads": {"decode": {"input_len": 128, "output_len": 384, "requests": 48, "rate": "inf"},
                      "prefill": {"input_len": 1024, "output_len": 16, "requests": 48, "rate": "inf"}},
        "suites": suites,
        "reference": "stock",
        "configs": configs,
    }  # fmt: skip


def test_pooled_share_counts_the_held_out_suites_only():
    kept = frontier.pooled(_answers(niah=(0, 24), multi=(10, 20), agree=(20, 20), longreply=(10, 10)))
    assert (kept["hits"], kept["n"]) == (40, 50) and kept["share"] == pytest.approx(0.8)
    assert kept["ci95"] == pytest.approx(list(wilson(40, 50))) and kept["suites"] == ["multi", "agree", "longreply"]
    assert frontier.pooled(_answers(niah=(5, 10))) is None  # the tuning suite alone pools nothing
    assert frontier.pooled({"multi": {"error": "x"}}) is None


def test_goodput_is_requests_per_second_times_the_share_kept_and_its_ratios():
    kept = frontier.pooled(_answers(multi=(10, 20), agree=(20, 20), longreply=(10, 10)))
    g = frontier.goodput(0.5, kept)
    assert g["value"] == pytest.approx(0.5 * 0.8)
    assert g["ci95"] == pytest.approx([0.5 * kept["ci95"][0], 0.5 * kept["ci95"][1]])
    assert frontier.goodput(None, kept) is None and frontier.goodput(0.5, None) is None
    configs = _result()["configs"]
    # stock 0.2 x 40/50 = 0.16; stock fp8 0.4 x 30/50 = 0.24; vtoken floor 0.5 x 20/50 = 0.2
    assert configs["stock"]["goodput"]["value"] == pytest.approx(0.16)
    assert configs["vtoken-0.25-floor"]["vs"] == pytest.approx({"stock": 0.2 / 0.16, "stock-fp8": 0.2 / 0.24})
    assert configs["stock"]["vs"]["stock"] == pytest.approx(1.0)
    assert configs["vtoken-fp8-0.5"]["goodput"] is None and configs["vtoken-fp8-0.5"]["vs"] == {
        "stock": None,
        "stock-fp8": None,
    }


def test_the_page_has_a_row_per_configuration_and_lists_what_did_not_run():
    tables = frontier.tables(_result())
    md = markdown(tables)
    first = markdown(tables[:1]).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in first if line.startswith("| ")}
    assert {"stock", "stock-fp8", "vtoken-0.25-floor", "vtoken-fp8-0.5"} <= set(rows)
    assert "niah kept (tuning)" in md and "multi kept (held-out)" in md and "pooled kept (held-out)" in md
    floor = rows["vtoken-0.25-floor"]
    assert "| 0.25, floor 0.5 |" in floor and "| 0.500 | 0.250 |" in floor and "| 900 / 3100 | 41.5 / 60.0 |" in floor
    assert "| 20/50 (40%, " in floor and "| 0.200 (" in floor and "| x1.25 / x0.83 |" in floor
    assert floor.endswith("| x1.25 / x0.83 | x2.50 / x1.25 |")  # goodput's ratios, then requests per second's
    assert "| 40/50 (80%, " in rows["stock"] and "| x1.00 / x0.67 |" in rows["stock"]
    assert "| error | error |" in rows["vtoken-fp8-0.5"] and rows["vtoken-fp8-0.5"].endswith("| - | - / - | - / - |")
    assert tables[-1].title == "Configurations that did not run"
    assert {r[1] for r in tables[-1].rows} == {"decode", "prefill", "niah", "multi", "agree", "longreply"}
    assert "128 MiB: 2912 tokens at fp32, 11650 at fp8" in md


def test_the_plot_draws_a_labelled_point_per_configuration_that_ran():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    frontier.plot(_result(), fig)
    labels = {t.get_text() for t in fig.axes[0].texts}
    plt.close(fig)
    assert labels == {"stock", "stock-fp8", "vtoken-0.25-floor"}


def test_the_defaults_are_chosen_on_the_tuning_suite_alone():
    """The best served-correct goodput on niah wins; a better held-out share does not (it only shows the cost),
    and neither stock nor vToken on another KV dtype is a candidate."""
    result = _result()
    result["configs"].update(
        {
            # 0.30 x 18/24 = 0.225, the best on the tuning suite, though the worst held out
            "vtoken-0.25": _config("vtoken-0.25", 0.30, _answers(niah=(18, 24), multi=(2, 20), agree=(2, 20))),
            # 0.20 x 24/24 = 0.2, every held-out answer kept
            "vtoken-0.5": _config("vtoken-0.5", 0.20, _answers(niah=(24, 24), multi=(20, 20), agree=(20, 20))),
            # fp8 0.9 x 24/24: not a candidate (the KV dtype is the user's lever)
            "vtoken-fp8-0.25": _config("vtoken-fp8-0.25", 0.9, _answers(niah=(24, 24), multi=(1, 20))),
        }
    )
    cands, best = frontier.choice(result)  # vtoken-0.25-floor: 0.5 x 12/24 = 0.25 > 0.225
    assert cands == ["vtoken-0.25-floor", "vtoken-0.25", "vtoken-0.5"] and best == "vtoken-0.25-floor"
    result["configs"]["vtoken-0.25-floor"]["answers"]["niah"] = _answers(niah=(10, 24))["niah"]  # 0.208
    assert frontier.choice(result)[1] == "vtoken-0.25"
    table = frontier.tables(result)[1]
    assert table.title.startswith("The defaults") and table.rows[0][0] == "**vtoken-0.25**"
    assert "The best, in bold: vtoken-0.25." in table.note


def test_the_shipped_defaults_are_the_committed_frontiers_choice():
    """vtoken/config.py's budget, floor and recall are the best tuning-suite goodput of docs/results/frontier.json:
    a new frontier run that chooses otherwise fails here until the defaults follow it (or say why not)."""
    import json
    from pathlib import Path

    from vtoken.config import SHIPPED_BUDGET, VTokenConfig

    result = json.loads((Path(__file__).parents[1] / "docs/results/frontier.json").read_text())
    _, best = frontier.choice(result)
    chosen = result["configs"][best]["settings"]
    shipped = VTokenConfig()
    assert SHIPPED_BUDGET == shipped.budget
    assert (chosen["budget"], chosen["vtoken"]["pressure_floor"]) == (shipped.budget, shipped.pressure_floor)
    recall = chosen["vtoken"].get("recall_every", 16)
    norecall = result["configs"].get("vtoken-0.5-norecall")
    with_recall = result["configs"].get("vtoken-0.5")
    # recall: off when, at the same budget, it finds no more needles on the tuning suite than no recall
    assert norecall and with_recall, "the frontier compares recall with none"
    buys = with_recall["answers"]["niah"]["hits"] > norecall["answers"]["niah"]["hits"]
    assert shipped.recall_every == (recall if buys else 0)


def test_a_suite_added_to_an_earlier_run_is_answered_on_its_settings_and_pooled_again(tmp_path, monkeypatch):
    """``--add-to``: every configuration of the earlier run answers the new suite (stock first, for the reference)
    with the settings it ran with; pooled shares, goodput and ratios count the new suite, the throughput stays as
    measured, the page says what was added; a suite already answered, or settings that differ, are refused."""
    import argparse
    import json

    earlier = argparse.Namespace(policy="snapkv", floor=0.5, prefill_chunk=256, recall_every=16)
    result = _result()
    del result["configs"]["vtoken-fp8-0.5"]
    for name, c in result["configs"].items():
        c["answers"].pop("longreply")
        c["kept"] = frontier.pooled(c["answers"])
        c["goodput"] = frontier.goodput(c["throughput"]["decode"]["request_throughput"], c["kept"])
        c["settings"]["vtoken"] = {
            k: v for k, v in frontier.CONFIGS[name].vtoken(earlier).items() if k != "recall_every"
        }
    del result["suites"]["longreply"]
    shared = {"model": "smollm2-135m", "prompts": 20, "lengths": "1024", "kv_bytes": 128 << 20, "policy": "snapkv",
              "floor": 0.5, "prefill_chunk": 256, "max_num_batched_tokens": 1024}  # fmt: skip
    result.update(settings=shared, max_model_len=1088, machine={"cpus": 2})
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(result))

    calls = []

    def answers(args, config, folder, tok, cases, reference):
        calls.append((config.name, config.vtoken(args), args.kv_bytes, args.max_model_len))
        hits = {"stock": 10, "stock-fp8": 5, "vtoken-0.25-floor": 0}[config.name]
        return _answers(**{s: (hits, 10) for s in cases}), 1

    monkeypatch.setattr(frontier, "_model", lambda name: ("folder", None))
    case = argparse.Namespace(prompt=[1] * 1000)  # 1,000 + longreply's 256 tokens: max_model_len 1,280
    monkeypatch.setattr(frontier, "_cases", lambda tok, names, lengths, n: {s: [case] * 10 for s in names})
    monkeypatch.setattr(frontier, "_suite", lambda name, cases, lengths: {"split": "held-out", "n": len(cases)})
    monkeypatch.setattr(frontier, "answers", answers)
    args = argparse.Namespace(add_to=str(path), suites="longreply", recall_every=0, model="other", kv_bytes=1)
    out = frontier.add(args)

    assert [c[0] for c in calls] == ["stock", "stock-fp8", "vtoken-0.25-floor"]
    floor = calls[2][1]
    assert floor["budget"] == 0.25 and floor["pressure_floor"] == 0.5 and floor["recall_every"] == 16
    assert {c[2] for c in calls} == {128 << 20} and {c[3] for c in calls} == {1280}
    c = out["configs"]["vtoken-0.25-floor"]  # 6/20 + 10/20 + 0/10 held out
    assert (c["kept"]["hits"], c["kept"]["n"]) == (16, 50) and c["kept"]["suites"] == ["multi", "agree", "longreply"]
    assert (
        c["goodput"]["value"] == pytest.approx(0.5 * 16 / 50) and c["throughput"]["decode"]["request_throughput"] == 0.5
    )
    assert c["vs"]["stock"] == pytest.approx((0.5 * 16 / 50) / (0.2 * 40 / 50))
    assert out["added"][0]["suites"] == ["longreply"] and "longreply" in out["suites"]
    assert "longreply: answered by a later run on the same settings" in markdown(frontier.tables(out))
    assert "one run (longreply answered by a second on its settings)" in frontier.trade(out, "x.md")

    with pytest.raises(SystemExit, match="has not answered"):
        frontier.add(argparse.Namespace(**{**vars(args), "suites": "multi"}))
    result["configs"]["vtoken-0.25-floor"]["settings"]["vtoken"]["policy"] = "h2o"
    path.write_text(json.dumps(result))
    calls.clear()
    with pytest.raises(SystemExit, match="vtoken-0.25-floor ran with"):
        frontier.add(args)
    assert calls == []  # refused before any configuration answered


def test_a_throughput_only_run_plots_its_requests_per_second():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = _result()
    for c in result["configs"].values():
        c["answers"], c["kept"], c["goodput"] = {}, None, None
    fig = plt.figure()
    frontier.plot(result, fig)
    heights = [round(b.get_height(), 3) for b in fig.axes[0].patches]
    plt.close(fig)
    assert heights == [0.2, 0.4, 0.5]  # stock, stock fp8, the floor; the one that did not start has no bar


def test_a_run_records_the_commit_of_the_code_that_ran_not_of_the_working_folder(tmp_path, monkeypatch):
    """A run from a frozen worktree (or any folder) records the commit of the checkout its code came from."""
    import subprocess
    from pathlib import Path

    repo = Path(frontier.__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("vtoken is not in a git checkout here")
    monkeypatch.chdir(tmp_path)  # not a checkout
    assert frontier._git()["commit"] == head
