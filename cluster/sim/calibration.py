"""What a simulated replica is made of, as measured on the real engine (``vtoken/bench/calibrate.py`` writes the JSON).

Two models, both fitted from vLLM runs with vToken on this machine:

- ``StepTime``: seconds of one engine step from what it schedules, least squares over measured steps::

      step_s = base + per_decode * decode_seqs + per_decode_kv * live tokens of the decoding requests
             + per_prefill_token * prefill_tokens + per_prefill_seq * prefill_seqs

  (a decoding request's attention reads its live tokens: vToken packs them, so eviction makes decodes cheaper)

  plus ``per_stream`` per decoding request: what serving adds to each token (the engine's output processing in
  the replica actor, Ray's streaming, the gateway), which the offline engine runs above do not see. It is
  taken from a measured serving run, a heavy request alone (``calibrate.serving``).

- ``BlockProfile``: blocks a request holds during a forward, from the engine's per-request trace
  (``blocks_per_forward``) for one (mode, prefill_evict, prefill_chunk) under the calibrated policy and
  budget. Stored as a ratio of the blocks the whole context would take (``ceil(ctx / bs) + 1``) by context
  length, separately for prefill and decode forwards: a ratio carries over to lengths the runs did not have
  (a budget keeps a share of the context), where raw block counts would not.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "results" / "fleet_calibration.json"


@dataclass(frozen=True)
class StepTime:
    base: float
    per_decode: float
    per_prefill_token: float
    per_prefill_seq: float
    per_decode_kv: float = 0.0
    per_stream: float = 0.0  # the serving path, per token streamed (AsyncLLM, the Ray actor, the gateway)

    def seconds(self, decode_seqs: int, prefill_tokens: int, prefill_seqs: int, decode_kv: int = 0) -> float:
        return (
            self.base
            + (self.per_decode + self.per_stream) * decode_seqs
            + self.per_prefill_token * prefill_tokens
            + self.per_prefill_seq * prefill_seqs
            + self.per_decode_kv * decode_kv
        )


def profile_key(mode: str, prefill_evict: bool, prefill_chunk: int | None) -> str:
    return f"{mode}/{'evict' if prefill_evict else 'keep'}/chunk{prefill_chunk or 'none'}"


def full_blocks(ctx: int, block_size: int) -> int:
    """Blocks a context of ``ctx`` tokens takes without eviction, with the block being filled."""
    return -(-ctx // block_size) + 1


@dataclass(frozen=True)
class BlockProfile:
    """Invariant: ``blocks(ctx, ...)`` is in ``[1, full_blocks(ctx)]``; ``*_ctx`` are sorted ascending."""

    prefill_ctx: tuple[int, ...]
    prefill_ratio: tuple[float, ...]
    decode_ctx: tuple[int, ...]
    decode_ratio: tuple[float, ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
        # Clamped at both ends: beyond the calibrated lengths a budget keeps the same share.
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return ys[0]
        if i >= len(xs):
            return ys[-1]
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)

    def blocks(self, ctx: int, prefill: bool, block_size: int) -> int:
        key = (ctx, prefill)
        b = self._cache.get(key)
        if b is None:
            full = full_blocks(ctx, block_size)
            xs, ys = (self.prefill_ctx, self.prefill_ratio) if prefill else (self.decode_ctx, self.decode_ratio)
            b = self._cache[key] = max(1, min(full, math.ceil(self._interp(xs, ys, ctx) * full - 1e-6)))
        return b

    def to_json(self) -> dict[str, Any]:
        return {
            "prefill_ctx": list(self.prefill_ctx),
            "prefill_ratio": list(self.prefill_ratio),
            "decode_ctx": list(self.decode_ctx),
            "decode_ratio": list(self.decode_ratio),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BlockProfile:
        return cls(tuple(d["prefill_ctx"]), tuple(d["prefill_ratio"]), tuple(d["decode_ctx"]), tuple(d["decode_ratio"]))

    @classmethod
    def full(cls) -> BlockProfile:
        """No eviction (stock vLLM): every token held."""
        return cls((1,), (1.0,), (1,), (1.0,))


@dataclass(frozen=True)
class Calibration:
    """A replica's engine as measured: ``step_time`` per mode, ``profiles`` by ``profile_key``, vLLM's
    scheduler limits, and the prompt lengths of ``vtoken bench goodput``'s load in tokens."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    step_time: dict[str, StepTime]
    profiles: dict[str, BlockProfile]
    goodput: dict[str, int]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def profile(self, mode: str, prefill_evict: bool, prefill_chunk: int | None) -> BlockProfile:
        if mode == "off":
            return BlockProfile.full()
        key = profile_key(mode, prefill_evict, prefill_chunk)
        if key not in self.profiles:
            raise ValueError(f"no calibrated block profile {key!r}; calibrated: {', '.join(sorted(self.profiles))}")
        return self.profiles[key]

    def steps(self, mode: str) -> StepTime:
        return self.step_time.get(mode) or self.step_time["vtoken"]

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "step_time": {m: vars(s) for m, s in self.step_time.items()},
            "profiles": {k: p.to_json() for k, p in self.profiles.items()},
            "goodput": self.goodput,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        return cls(
            d["block_size"],
            d["max_num_batched_tokens"],
            d["max_num_seqs"],
            {m: StepTime(**s) for m, s in d["step_time"].items()},
            {k: BlockProfile.from_json(p) for k, p in d["profiles"].items()},
            d["goodput"],
            d.get("meta", {}),
        )


def load(path: str | Path | None = None) -> Calibration:
    p = Path(path) if path else DEFAULT_PATH
    if not p.exists():
        raise FileNotFoundError(f"{p}: no fleet calibration; make one with `vtoken bench fleet --calibrate`")
    return Calibration.from_json(json.loads(p.read_text()))


def save(cal: Calibration, path: str | Path | None = None) -> Path:
    p = Path(path) if path else DEFAULT_PATH
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal.to_json(), indent=1))
    return p
