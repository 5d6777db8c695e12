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
    assert "| 40/50 (80%, " in rows["stock"] and "| x1.00 / x0.67 |" in rows["stock"]
    assert "| error | error |" in rows["vtoken-fp8-0.5"] and rows["vtoken-fp8-0.5"].endswith("| - | - / - |")
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
