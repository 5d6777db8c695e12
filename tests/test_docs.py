"""The documentation holds to what it documents: the generated pages (configuration and CLI reference, every
results page, the README's headline table) equal what scripts/render_docs.py renders now from the code and the
committed JSON; the README stays a front door (short, its links resolve, the test command CI runs named in it);
and one default budget holds in VTokenConfig, every serve config and every benchmark. No engine; a few seconds."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_page_equals_what_its_code_and_json_render_now():
    render = _render_docs()
    stale = render.stale(render.pages())
    assert not stale, f"stale (run python scripts/render_docs.py): {[str(p.relative_to(ROOT)) for p in stale]}"


def test_the_check_finds_a_page_that_drifted_from_its_json(tmp_path, monkeypatch):
    render = _render_docs()
    page = ROOT / "docs" / "results" / "concurrency_default_all.md"
    rendered = render.pages()
    drifted = rendered[page].replace("| 16 |", "| 17 |", 1)
    assert drifted != rendered[page]
    copy = tmp_path / page.name
    copy.write_text(drifted)
    assert render.stale({copy: rendered[page]}) == [copy]


def test_no_description_in_the_reference_stops_mid_sentence():
    """Every command's, flag's and key's description is whole: a benchmark's is its docstring's first paragraph, not
    its first line (four of them once stopped at "after the", "budget and", "to stock" and "task through")."""
    render = _render_docs()
    rendered = render.pages()
    for page in render.REFERENCE:
        assert render.cut_short(rendered[page]) == [], page.name


def test_the_mid_sentence_check_finds_a_description_cut_at_its_first_line():
    from vtoken.bench import concurrency, lmeval

    render = _render_docs()
    cli = render.pages()[ROOT / "docs" / "reference" / "cli.md"]
    for module in (concurrency, lmeval):
        whole, first_line = " ".join(module.__doc__.split("\n\n")[0].split()), module.__doc__.splitlines()[0]
        assert whole in cli and first_line != whole
        assert len(render.cut_short(cli.replace(whole, first_line, 1))) == 1, module.__name__
    flag = "| `--out` | `bench_out` | folder for the results |"
    assert flag in cli and render.cut_short(cli.replace(flag, "| `--out` | `bench_out` | folder for the |", 1))


def test_every_config_key_and_cli_command_is_in_the_reference():
    from cluster.config import ServeConfig
    from vtoken.config import VTokenConfig

    config = (ROOT / "docs" / "reference" / "config.md").read_text()
    for name in VTokenConfig.model_fields:
        assert f"| `{name}` |" in config, name
    for section in ("engine", "replica", "placement", "autoscaling", "gateway", "ray"):
        for name in ServeConfig.model_fields[section].annotation.model_fields:
            assert f"| `{section}.{name}` |" in config, f"{section}.{name}"
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for command in ("serve", "generate", "status", "scale", "demo", "vllm-args", "bench concurrency"):
        assert f"## `vtoken {command}`" in cli, command


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    assert "bash scripts/test.sh" in text and "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert not re.search(r"/work/|/root/|issue \d+", text), "machine paths and issue numbers belong in git, not here"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_mkdocs_is_pinned_in_the_dev_extra_that_setup_installs():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert {r.split("==")[0] for r in dev if "==" in r} >= {"mkdocs", "mkdocs-material"}, dev
    assert "[$flavour,dev]" in (ROOT / "scripts" / "setup.sh").read_text()
    assert "mkdocs build --strict" in (ROOT / "scripts" / "test.sh").read_text()
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert nav["theme"]["name"] == "material" and nav["strict"] is True


# --- one default --------------------------------------------------------------------------------------------------


def _bench_budget_defaults() -> dict[str, object]:
    """Benchmark -> the default of its --budget (one value) or --budgets (a comma list)."""
    from vtoken.bench import BENCHMARKS

    out = {}
    for name, path in {**BENCHMARKS, "tp": "vtoken.bench.tp"}.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(path).add_args(parser)
        defaults = {a.dest: a.default for a in parser._actions}
        if "budget" in defaults:
            out[name] = float(defaults["budget"])
        elif "budgets" in defaults:
            out[name] = [float(b) for b in str(defaults["budgets"]).split(",")]
    return out


def test_one_default_budget_in_the_config_every_serve_config_and_every_benchmark():
    """The shipped budget (VTokenConfig) is the one every serve config sets and every benchmark runs by default (a
    sweep includes it). `vtoken demo` is left out on purpose: it shows repacking at h2o 25% with `evict: always`."""
    from vtoken.config import VTokenConfig

    shipped = VTokenConfig().budget
    for path in sorted((ROOT / "configs").glob("serve*.yaml")):
        assert yaml.safe_load(path.read_text())["vtoken"]["budget"] == shipped, path.name
    benches = _bench_budget_defaults()
    assert {"concurrency", "sla", "serve", "overhead", "keyscores", "tp"} <= set(benches)
    for name, default in benches.items():
        assert default == shipped if isinstance(default, float) else shipped in default, (name, default)


def test_the_readme_and_concepts_state_the_shipped_budget_and_prefix_caching_on():
    from vtoken.config import VTokenConfig

    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"The shipped default budget is **{VTokenConfig().budget}**" in readme
    assert "**on by default**, as in stock vLLM" in readme
    concepts = (ROOT / "docs" / "concepts.md").read_text()
    assert "## Prefix caching\n\nOn by default, as in stock vLLM" in concepts
