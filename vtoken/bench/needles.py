"""A RULER-style needle-in-a-haystack suite (Hsieh et al., 2024), built deterministically from text the machine
ships and needles made from a seed.

Haystack: the docstrings of Python's standard library (modules, classes, functions; human-written English the
rest of vToken never uses for its prompts). Needles: "One of the special magic numbers for <key> is: <value>."
with a two-word key and a 7-digit value. Tasks (RULER's names):

  niah_single    one needle; the question asks for it
  niah_multikey  four needles with different keys (three distractors); the question asks for one of them

Each prompt: RULER's instruction, the haystack with the needles at their depths (a depth is where the asked
needle sits, as a share of the haystack's tokens; distractors are spread around it), then the question and the
answer's first words, so that the model's next tokens are the value. A hit is the value in the first generated
tokens. Prompts are token ids of the model's tokenizer, each close to its target length.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import NamedTuple

import numpy as np

ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "narrow", "odd", "pale", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "wise", "young",
)  # fmt: skip
NOUNS = (
    "anchor", "badger", "cactus", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "nickel", "orchard", "pepper", "quarry", "river", "saddle", "tunnel", "violin", "walnut",
)  # fmt: skip
MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "collections", "configparser", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gzip", "hashlib",
    "heapq", "html.parser", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox",
    "mimetypes", "numbers", "pathlib", "pickle", "pprint", "queue", "random", "sched", "secrets", "selectors",
    "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
)  # fmt: skip
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? The special magic number for "
    "{key} mentioned in the provided text is"
)
TASKS = ("niah_single", "niah_multikey")


class Case(NamedTuple):
    task: str
    length: int  # target prompt length, tokens
    depth: float  # where the asked needle sits, share of the haystack
    key: str
    answer: str
    prompt: list[int]


@functools.cache
def haystack_text() -> str:
    """Docstrings of the standard library, in a fixed order: modules, then their public members."""
    parts: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a module this Python lacks (e.g. sqlite3 without its library): skip it
            continue
        for _, obj in [("", mod), *sorted(inspect.getmembers(mod), key=lambda kv: kv[0])]:
            if obj is not mod and (getattr(obj, "__module__", None) != name or not callable(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(doc.strip())
    return "\n\n".join(dict.fromkeys(parts))  # without repeats


def build(tok, lengths=(1024, 2048, 4096), depths: int = 12, seed: int = 0, tasks=TASKS) -> list[Case]:
    """The suite: every task x length x depth (depths spread evenly over 5%..95%)."""
    rng = np.random.default_rng(seed)
    ids = tok(haystack_text(), add_special_tokens=False)["input_ids"]
    out = []
    for task in tasks:
        for length in lengths:
            for depth in np.linspace(0.05, 0.95, depths):
                out.append(_case(tok, ids, rng, task, length, float(depth), offset=(len(out) * 7919) % len(ids)))
    return out


def _case(tok, ids: list[int], rng, task: str, length: int, depth: float, offset: int) -> Case:
    keys = set()
    while len(keys) < (4 if task == "niah_multikey" else 1):
        keys.add(f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}")
    keys = sorted(keys)
    values = [str(rng.integers(1_000_000, 10_000_000)) for _ in keys]
    asked = int(rng.integers(len(keys)))
    enc = functools.partial(tok, add_special_tokens=False)
    needles = [enc(" " + NEEDLE.format(key=k, value=v) + " ")["input_ids"] for k, v in zip(keys, values)]
    head = tok(INTRO)["input_ids"]  # with the tokenizer's own start, as a plain prompt would have
    question = enc(QUESTION.format(key=keys[asked]))["input_ids"]
    room = length - len(head) - len(question) - sum(map(len, needles))
    hay = [ids[(offset + j) % len(ids)] for j in range(room)]
    # The asked needle at its depth; distractors at depths spread around the haystack, never on top of it.
    spots = {asked: depth}
    others = [d for d in np.linspace(0.05, 0.95, len(keys) + 1) if abs(d - depth) > 0.1][: len(keys) - 1]
    for k, d in zip([k for k in range(len(keys)) if k != asked], others):
        spots[k] = float(d)
    body, last = [], 0
    for k in sorted(spots, key=spots.get):
        cut = _sentence_end(tok, hay, int(spots[k] * len(hay)))
        body += hay[last:cut] + needles[k]
        last = cut
    body += hay[last:]
    return Case(task, length, depth, keys[asked], values[asked], head + body + question)


def _sentence_end(tok, hay: list[int], at: int) -> int:
    """The first token at or after ``at`` that follows a full stop (so a needle never splits a sentence)."""
    for j in range(at, min(at + 64, len(hay))):
        if tok.decode(hay[j - 1 : j]).rstrip().endswith((".", "\n")):
            return j
    return at


def hit(answer: str, text: str) -> bool:
    """The value, as digits, among the first numbers the model wrote."""
    digits = "".join(c if c.isdigit() else " " for c in text).split()
    return answer in digits[:2]


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sound at 0 and n, unlike the normal approximation)."""
    if n == 0:
        return 0.0, 0.0
    p = hits / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float((centre - half) / (1 + z * z / n)), float((centre + half) / (1 + z * z / n))
