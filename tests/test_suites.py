"""The retrieval bench's suites without an engine: the held-out prompts are deterministic, as long as asked, with
their needles and questions where they should be and the chat template applied; the metrics on hand-made replies,
negative cases included; the tuning suite's role and prompts unchanged."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest

from vtoken.bench import agree, idle_text, needles, retrieval
from vtoken.bench.suites import SUITES, reply


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    from vtoken.models import model_path

    return AutoTokenizer.from_pretrained(str(model_path("smollm2-135m")))


@functools.cache
def suite(name: str, seed: int = 0) -> list[needles.Case]:
    return SUITES[name].build(tokenizer(), [1024, 2048], 20 if name != "niah" else 3, seed)


def text(case) -> str:
    return tokenizer().decode(case.prompt)


# ------------------------------------------------------------------------------------------ the suites' roles
def test_only_niah_is_tuned_on_and_stays_the_default():
    assert [n for n, s in SUITES.items() if s.tuning] == ["niah"]
    assert "tuning" in SUITES["niah"].role and all("held out" in SUITES[n].role for n in ("multi", "agree"))
    import argparse

    p = argparse.ArgumentParser()
    retrieval.add_args(p)
    assert p.parse_args([]).suite == "niah"


def test_the_held_out_text_is_none_the_project_used_before():
    """The manual holds no number of seven digits (a needle's value is never confused with the haystack), and
    neither held-out text shares a passage with the tuning suite's docstrings or vtoken/texts.py's documents."""
    from vtoken.texts import python_docs

    man, notes = idle_text.manual(), idle_text.release_notes()
    assert len(man) > 30_000 and len(notes) > 60_000
    assert not re.search(r"(?<!\d)\d{7}(?!\d)", man)
    used = needles.haystack_text() + python_docs()
    for held in (man, notes):
        lines = [line for line in held.splitlines() if len(line) > 60]
        assert sum(line in used for line in lines) < 0.02 * len(lines)


@pytest.mark.parametrize("name", ["multi", "agree"])
def test_held_out_suites_are_deterministic(name):
    a, b = suite(name), SUITES[name].build(tokenizer(), [1024, 2048], 20, 0)
    assert [c.prompt for c in a] == [c.prompt for c in b] and [c.answer for c in a] == [c.answer for c in b]
    other = SUITES[name].build(tokenizer(), [1024, 2048], 20, 1)
    assert [c.key for c in other] != [c.key for c in a]  # the seed decides


@pytest.mark.parametrize("name", ["multi", "agree"])
def test_held_out_suites_have_forty_prompts_near_their_lengths_and_depths(name):
    cases = suite(name)
    assert len(cases) == 40 and [c.length for c in cases] == [1024] * 20 + [2048] * 20
    assert all(abs(len(c.prompt) - c.length) <= 8 for c in cases), [len(c.prompt) - c.length for c in cases]
    for length in (1024, 2048):
        depths = [c.depth for c in cases if c.length == length]
        assert 0.03 <= min(depths) <= 0.15 and 0.85 <= max(depths) <= 0.95
        assert np.corrcoef(depths, np.linspace(0.1, 0.9, 20))[0, 1] > 0.95  # spread as asked


@pytest.mark.parametrize("name", ["multi", "agree"])
def test_prompts_go_through_the_chat_template(name):
    tok = tokenizer()
    for c in suite(name)[::7]:
        t = text(c)
        assert t.startswith("<|im_start|>system\n") and t.count("<|im_start|>user\n") == 1
        assert "<|im_end|>\n<|im_start|>assistant\n" in t and t.count("<|im_start|>") == 3
        assert c.prompt[0] == tok.convert_tokens_to_ids("<|im_start|>")  # special tokens, not their spelling


# ------------------------------------------------------------------------------------------------------ multi
def test_multi_needles_have_look_alike_keys_and_sit_at_their_depth():
    for c in suite("multi"):
        t = text(c)
        found = re.findall(r"The access code for ([a-z]+-[a-z]+) is: (\d{7})\.", t)
        assert len(found) == 3
        found = dict(found)
        assert found[c.key] == c.answer and len(set(found.values())) == 3
        a, n = c.key.split("-")
        others = [k for k in found if k != c.key]
        assert sorted(k.split("-")[0] == a for k in others) == [False, True]  # b-n and a-m
        assert sorted(k.split("-")[1] == n for k in others) == [False, True]
        # where the asked needle sits, as a share of the text between "Text:" and the closing question
        body = t[t.index("Text:\n") : t.rindex("\n\nQuestion:")]
        at = body.index(f"The access code for {c.key} is:")
        share = len(tokenizer()(body[:at])["input_ids"]) / len(tokenizer()(body)["input_ids"])
        assert abs(share - c.depth) < 0.05, (share, c.depth)  # the distractors count here, not in depth


def test_multi_asks_before_and_after_the_text_and_the_reply_starts_the_answer():
    for c in suite("multi")[::5]:
        t = text(c)
        q = f"Question: What is the access code for {c.key}?"
        assert t.count(q) == 2 and t.index(q) < t.index("Text:\n") < t.rindex(q)
        assert t.endswith(f"<|im_start|>assistant\nThe access code for {c.key} is:")


def test_multi_hit_on_hand_made_replies():
    tok = tokenizer()
    c = suite("multi")[0]
    distractor = re.findall(r"is: (\d{7})\.", text(c))
    distractor = next(v for v in distractor if v != c.answer)
    hit = SUITES["multi"].hit
    assert hit(c, f" {c.answer}.", "")
    assert hit(c, f" {c.answer[:3]} {c.answer[3:]}", "") is False  # split digits are another number
    assert not hit(c, f" {distractor}.", "")  # the look-alike key's value
    assert not hit(c, f" 12, 13 and {c.answer}", "")  # not among the first two numbers
    assert not hit(c, " I do not know.", "")
    # a chat reply ends at the end of the turn: the value generated after it does not count
    ids = tok(" I do not know.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids += tok(f" {c.answer}", add_special_tokens=False)["input_ids"]
    assert reply(tok, ids, chat=True) == " I do not know." and not hit(c, reply(tok, ids, chat=True), "")
    assert c.answer in reply(tok, ids, chat=False)  # the tuning suite's replies are taken whole, as before


# ------------------------------------------------------------------------------------------------------ agree
def test_agree_asks_about_a_name_that_occurs_once_near_the_depth():
    for c in suite("agree"):
        t = text(c)
        doc = t[t.index(agree.INTRO) + len(agree.INTRO) : t.rindex("\n\nQuestion:")]
        assert t.rstrip().endswith(f"Question: {agree.question(c)}<|im_end|>\n<|im_start|>assistant")
        found = [m.start() for m in agree.NAME.finditer(doc) if m.group() == c.key]
        assert len(found) == 1, c.key  # the question points at one place
        share = len(tokenizer()(doc[: found[0]])["input_ids"]) / len(tokenizer()(doc)["input_ids"])
        assert abs(share - c.depth) < 0.1, (c.key, share, c.depth)  # in the entry at the depth


def test_agreement_on_hand_made_replies():
    q = 'What does the text say about "Squeezer"? Answer in one sentence.'
    full = "The Squeezer collapses long output in the Shell into a button that expands it when double-clicked."
    f1 = functools.partial(agree.agreement, question=q)
    assert f1(full, full) == 1.0 and agree.agrees(full, full, q)
    # the same facts reworded, or one word changed: still agreement
    assert agree.agrees("It says the Squeezer collapses long Shell output into a button; double-clicked, it expands.",
                        full, q)  # fmt: skip
    assert f1(full.replace("button", "label"), full) > 0.8
    # another entry's content, or the question echoed back: no agreement
    assert not agree.agrees("The text says that IDLE now supports tabbed windows on macOS.", full, q)
    assert f1('The text says about "Squeezer" that it is in the text.', full) == 0.0
    assert f1("", full) == 0.0 and f1("", "") == 1.0 and f1("the a of", "it is") == 1.0  # no content either side
    # half the substance shared sits at the threshold; less does not pass
    assert agree.agrees("squeezer collapses long output banana", "squeezer collapses long output apple", "")
    assert not agree.agrees("squeezer apple pear plum", "squeezer cherry grape lime", "")


def test_agree_scores_full_kv_at_one_hundred_percent_and_others_against_it():
    cases = suite("agree")[:4]
    full = ["Shell output is squeezed.", "It adds a menu.", "The debugger stops.", "Fonts are larger."]
    mine = ["Shell output gets squeezed.", "It removes nothing.", "The debugger stops.", ""]
    s = SUITES["agree"]
    r = retrieval._score(cases, full, None, s, full)
    assert r["hits"] == 4 and r["agreement"]["mean"] == 1.0
    r = retrieval._score(cases, mine, None, s, full)
    assert r["hits"] == 2 and r["n"] == 4 and 0 < r["ci95"][0] < 0.5 < r["ci95"][1]
    assert r["agreement"]["per_prompt"][2] == 1.0 and r["agreement"]["per_prompt"][3] == 0.0


def test_agree_refuses_to_run_without_full_kv():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    retrieval.add_args(p)
    with pytest.raises(SystemExit, match="full KV"):
        retrieval.run(p.parse_args(["--suite", "agree", "--no-full"]))


def test_a_reference_must_be_a_full_kv_run_of_the_same_prompts(tmp_path):
    cases = suite("agree")
    good = {"prompts_sha256": retrieval.prompts_digest(cases), "configs": {"full KV": {"answers": ["r"] * 40}}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert retrieval._reference(str(tmp_path / "good.json"), cases) == ["r"] * 40
    for bad in ({**good, "prompts_sha256": retrieval.prompts_digest(cases[:39])}, {**good, "configs": {}}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match="not a run of these prompts"):
            retrieval._reference(str(tmp_path / "bad.json"), cases)


# -------------------------------------------------------------------------------------------- niah, and merge
def test_niah_is_the_needle_suite_as_before():
    """The default suite builds exactly what needles.build built (existing results stay reproducible)."""
    tok = tokenizer()
    a = SUITES["niah"].build(tok, [1024], 3, 0)
    b = needles.build(tok, [1024], 3)
    assert [c.prompt for c in a] == [c.prompt for c in b]
    c = a[0]
    assert SUITES["niah"].hit(c, f" {c.answer}. And", "") and not SUITES["niah"].hit(c, " 1234567", "")


def test_merge_refuses_another_suite_and_other_full_kv_replies(tmp_path):
    def run(name, suite, full_answers, configs=("x@0.25:park",)):
        r = {"command": name, "prompts": 2, "lengths": [1024], "budgets": [0.25], "suite": {"name": suite},
             "configs": {k: {"answers": ["a", "b"]} for k in configs}, "saturated": {}}  # fmt: skip
        if full_answers:
            r["configs"]["full KV"] = {"answers": full_answers}
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(r))
        return str(p)

    a, b = run("a", "agree", ["x", "y"]), run("b", "agree", ["x", "y"], ("x@0.25:always",))
    assert set(retrieval.merge([a, b])["configs"]) == {"full KV", "x@0.25:park", "x@0.25:always"}
    with pytest.raises(SystemExit, match="another suite"):
        retrieval.merge([a, run("c", "multi", ["x", "y"])])
    with pytest.raises(SystemExit, match="other full-KV replies"):
        retrieval.merge([a, run("d", "agree", ["x", "z"])])
    old = run("e", "niah", ["x", "y"])  # a run from before --suite has no suite field: it was niah
    legacy = json.loads(open(old).read())
    del legacy["suite"]
    (tmp_path / "e.json").write_text(json.dumps(legacy))
    assert retrieval.merge([old, run("f", "niah", ["x", "y"])])["prompts"] == 2


def test_most_in_flight_counts_overlapping_requests():
    assert retrieval._most_in_flight([(0, 2), (1, 3), (2.5, 4), (5, 6)]) == 2
    assert retrieval._most_in_flight([(0, 9)] * 4 + [(10, 11)]) == 4


def test_tables_say_which_suite_and_its_role():
    base = {"model": "m", "prompts": 1, "lengths": [1024], "tasks": ["agree"], "prefill_chunk": 256}
    full = {"hits": 1, "n": 1, "accuracy": 1.0, "ci95": [0.2, 1.0], "agreement": {"mean": 1.0, "ci95": [1, 1]}}
    r = {**base, "suite": {"name": "agree", "role": SUITES["agree"].role}, "configs": {"full KV": full},
         "controls": {"no document": {**full, "hits": 0, "accuracy": 0.0}}}  # fmt: skip
    t = retrieval.tables(r)
    assert "Suite agree, held out" in t[0].title and t[1].rows[0][0] == "no document"
    legacy = {**base, "tasks": ["niah_single"], "configs": {"full KV": {**full, "agreement": None}}}
    assert "Suite niah, tuning suite" in retrieval.tables(legacy)[0].title
