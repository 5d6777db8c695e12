"""TokenTable: one request's map from logical tokens to physical KV slots.

A request's *logical* positions 0..num_logical-1 are the tokens of its prompt and output, in order; RoPE
always sees these. Its *physical* slots 0..physical_len-1 are the positions inside its own block list
(slot s lives in block ``block_ids[s // block_size]`` at offset ``s % block_size``); the attention kernel
reads slots ``[0, physical_len)``, so every slot in that range must hold a live token once compaction ran.

    logical  0 1 2 3 4 5 6 7 8 9          slot_of = [0 -1 2 3 -1 -1 6 7 1 9]
    live     x . x x . . x x x x          (token 8 was moved into the hole at slot 1)
    physical 0 1 2 3 4 5 6 7 8 9

Storage is one int32 per logical token (``slot_of``, -1 = evicted), grown in block-sized chunks like the
blocks themselves, plus one int32 per logical block counting its live tokens (what Naive-Evict's block
count needs, in O(blocks) rather than O(tokens)), so metadata stays at ~4 bytes per logical token (the
paper's table needs ~16). The inverse map (slot -> logical) is derived on demand in O(n) NumPy; it is
needed only when a compaction is planned or applied, never on the per-step path.

Invariants (``check_integrity``):
  * live slots are distinct and lie in ``[0, physical_len)``;
  * a token comes back to life only through ``revive`` (a parked token restored from the second tier, see
    vtoken/core/park.py); otherwise evicted entries stay -1;
  * ``block_live[b]`` counts the live tokens among logical positions ``[b * block_size, (b + 1) * block_size)``.
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int32
DEAD = -1


class TokenTableError(ValueError):
    """An operation that would break a TokenTable invariant."""


class TokenTable:
    """Per-request logical-token -> physical-slot map. Plain NumPy, scheduler side only."""

    __slots__ = ("block_size", "_slot_of", "_block_live", "_num_logical", "_physical_len", "_num_live")

    def __init__(self, block_size: int, num_tokens: int = 0) -> None:
        if block_size <= 0:
            raise TokenTableError(f"block_size must be positive, got {block_size}")
        self.block_size = int(block_size)
        self._slot_of = np.empty(0, dtype=SLOT_DTYPE)
        self._block_live = np.zeros(0, dtype=SLOT_DTYPE)
        self._num_logical = 0
        self._physical_len = 0
        self._num_live = 0
        if num_tokens:
            self.append(num_tokens)

    # ------------------------------------------------------------------ sizes
    @property
    def num_logical(self) -> int:
        """Tokens the request has produced or read so far (prompt + output), dead ones included."""
        return self._num_logical

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def physical_len(self) -> int:
        """Slots the attention kernel reads: the request's ``seq_len`` as vLLM sees it."""
        return self._physical_len

    @property
    def num_blocks(self) -> int:
        """Blocks the request needs for its physical slots (the block being filled included)."""
        return -(-self._physical_len // self.block_size)

    @property
    def nbytes(self) -> int:
        """Bytes of metadata held for this request (allocated capacity, not just the used part)."""
        return int(self._slot_of.nbytes + self._block_live.nbytes)

    def naive_blocks(self, writing: int = 0) -> int:
        """Blocks Naive-Evict holds (no token ever moves, so logical token ``i`` sits at slot ``i``): every
        block with a live token, plus the blocks the next ``writing`` tokens go to. With ``writing=0`` the
        block being filled counts as held (it waits for the next token). O(blocks)."""
        n, bs = self._num_logical, self.block_size
        held = int(np.count_nonzero(self._block_live[: n // bs]))
        if writing > 0:
            return held + (-(-(n + writing) // bs) - n // bs)
        return held + (1 if n % bs else 0)

    # ------------------------------------------------------------------ views
    @property
    def slot_of(self) -> np.ndarray:
        """Read-only view: physical slot of each logical token, -1 where evicted."""
        view = self._slot_of[: self._num_logical]
        view.flags.writeable = False
        return view

    def live_mask(self) -> np.ndarray:
        return self.slot_of >= 0

    def live_logical(self) -> np.ndarray:
        """Logical positions of the live tokens, ascending."""
        return np.flatnonzero(self.slot_of >= 0)

    def logical_of(self) -> np.ndarray:
        """Inverse map: logical token held by each physical slot, -1 for a hole. O(num_logical)."""
        inv = np.full(self._physical_len, DEAD, dtype=SLOT_DTYPE)
        live = self.live_logical()
        inv[self._slot_of[live]] = live
        return inv

    def physical_live_mask(self) -> np.ndarray:
        """Which physical slots hold a live token (what the compaction planner needs)."""
        mask = np.zeros(self._physical_len, dtype=bool)
        slots = self.slot_of
        mask[slots[slots >= 0]] = True
        return mask

    # ------------------------------------------------------------------ updates
    def append(self, n: int = 1) -> np.ndarray:
        """Add ``n`` new logical tokens at the physical end; returns their physical slots."""
        if n < 0:
            raise TokenTableError(f"cannot append {n} tokens")
        end = self._num_logical + n
        if end > self._slot_of.size:
            # Grow in whole blocks: capacity overhead is < block_size entries, never a doubling.
            cap = -(-end // self.block_size) * self.block_size
            grown = np.empty(cap, dtype=SLOT_DTYPE)
            grown[: self._num_logical] = self._slot_of[: self._num_logical]
            self._slot_of = grown
            counts = np.zeros(cap // self.block_size, dtype=SLOT_DTYPE)
            counts[: self._block_live.size] = self._block_live
            self._block_live = counts
        if n:
            # New tokens are live: add each block's share of [num_logical, end) to its count.
            first, last = self._num_logical // self.block_size, (end - 1) // self.block_size
            edges = np.clip(np.arange(first, last + 2) * self.block_size, self._num_logical, end)
            self._block_live[first : last + 1] += np.diff(edges).astype(SLOT_DTYPE)
        slots = np.arange(self._physical_len, self._physical_len + n, dtype=SLOT_DTYPE)
        self._slot_of[self._num_logical : end] = slots
        self._num_logical = end
        self._physical_len += n
        self._num_live += n
        return slots

    def kill(self, logical: np.ndarray) -> np.ndarray:
        """Evict logical tokens; returns the physical slots they vacated (holes until compaction).

        Killing a token twice, or one that does not exist, is an error: it would mean the policy and the
        table disagree about what is alive.
        """
        logical = np.asarray(logical, dtype=np.int64).ravel()
        if logical.size == 0:
            return np.empty(0, dtype=SLOT_DTYPE)
        if logical.min() < 0 or logical.max() >= self._num_logical:
            raise TokenTableError(f"kill out of range [0, {self._num_logical})")
        if np.unique(logical).size != logical.size:
            raise TokenTableError("kill lists a token twice")
        slots = self._slot_of[logical].copy()
        if (slots < 0).any():
            raise TokenTableError(f"kill of already-evicted tokens {logical[slots < 0][:8].tolist()}")
        self._slot_of[logical] = DEAD
        self._num_live -= logical.size
        np.subtract.at(self._block_live, logical // self.block_size, 1)
        return slots

    def revive(self, logical: np.ndarray, slots: np.ndarray) -> None:
        """Bring evicted tokens back at free physical ``slots`` (a parked token restored into the pool); the
        physical length grows to cover them. Reviving a live token or filling an occupied slot is an error."""
        logical = np.asarray(logical, dtype=np.int64).ravel()
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if logical.size != slots.size:
            raise TokenTableError(f"revive: {logical.size} tokens for {slots.size} slots")
        if logical.size == 0:
            return
        if logical.min() < 0 or logical.max() >= self._num_logical or slots.min() < 0:
            raise TokenTableError("revive out of range")
        if (self._slot_of[logical] >= 0).any() or np.unique(logical).size != logical.size:
            raise TokenTableError("revive of a live token, or of one token twice")
        taken = self.physical_live_mask()
        inside = slots[slots < taken.size]
        if taken[inside].any() or np.unique(slots).size != slots.size:
            raise TokenTableError("revive into an occupied slot")
        self._slot_of[logical] = slots
        self._num_live += logical.size
        np.add.at(self._block_live, logical // self.block_size, 1)
        self._physical_len = max(self._physical_len, int(slots.max()) + 1)

    def apply_moves(self, src: np.ndarray, dst: np.ndarray, physical_len: int | None = None) -> None:
        """Record that the KV of slot ``src[i]`` now lives at ``dst[i]`` (moves happen simultaneously).

        ``physical_len`` is the new attended length after compaction; every live token must lie below it.
        """
        src = np.asarray(src, dtype=np.int64).ravel()
        dst = np.asarray(dst, dtype=np.int64).ravel()
        if src.shape != dst.shape:
            raise TokenTableError(f"src and dst differ in length ({src.size} vs {dst.size})")
        new_len = self._physical_len if physical_len is None else int(physical_len)
        if src.size:
            inv = self.logical_of()
            if src.min() < 0 or src.max() >= self._physical_len or dst.min() < 0:
                raise TokenTableError("move slot out of range")
            owners = inv[src]
            if (owners < 0).any():
                raise TokenTableError(f"move from empty slots {src[owners < 0][:8].tolist()}")
            self._slot_of[owners] = dst
        live = self.slot_of[self.slot_of >= 0]
        if live.size and (live.max() >= new_len):
            raise TokenTableError(f"live token at slot {int(live.max())} beyond physical_len {new_len}")
        if np.unique(live).size != live.size:
            raise TokenTableError("moves put two live tokens in one slot")
        self._physical_len = new_len

    def reset(self) -> None:
        """Forget everything (preemption by recompute: the request starts over from logical token 0)."""
        self._slot_of = np.empty(0, dtype=SLOT_DTYPE)
        self._block_live = np.zeros(0, dtype=SLOT_DTYPE)
        self._num_logical = self._physical_len = self._num_live = 0

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        slots = self.slot_of
        live = slots[slots >= 0]
        if (slots < DEAD).any():
            raise TokenTableError("slot_of holds values below -1")
        if live.size != self._num_live:
            raise TokenTableError(f"num_live {self._num_live} != {live.size} live entries")
        if live.size and live.max() >= self._physical_len:
            raise TokenTableError("a live token lies beyond physical_len")
        if np.unique(live).size != live.size:
            raise TokenTableError("two live tokens share a slot")
        if self._physical_len > self._num_logical:
            raise TokenTableError("more physical slots than logical tokens")
        counts = np.bincount(np.flatnonzero(slots >= 0) // self.block_size, minlength=self._block_live.size)
        if not np.array_equal(counts, self._block_live):
            raise TokenTableError("per-block live counts disagree with slot_of")

    def __repr__(self) -> str:
        return (
            f"TokenTable(logical={self._num_logical}, live={self._num_live}, "
            f"physical_len={self._physical_len}, blocks={self.num_blocks}, block_size={self.block_size})"
        )
