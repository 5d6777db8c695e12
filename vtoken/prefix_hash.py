"""The prefix hash chain: one 64-bit hash per full block of a token sequence, computable from token ids alone.

vLLM hashes the blocks of its prefix cache with a seed drawn per process, so nobody outside an engine can recompute
its hashes. Placement needs to compare what a replica holds with what a request's prompt would read, so the replica
translates each block vLLM announces (actors/prefix_tracker.py) into this chain, and the gateway computes the same
chain for every prompt (cluster/serving/requests.py), as llm-d's prefix-aware router does with its own hash::

    h_{-1} = 0
    h_i    = blake2b(h_{i-1} as 8 bytes big-endian + block i's token ids as int32 little-endian, digest_size=8)

Only full blocks of ``block_size`` tokens have a hash (a partial block is never a prefix-cache hit). A hash names a
block together with everything before it, so two prompts share block i's hash only if they share blocks 0..i.
Plain stdlib: replicas, the controller, the gateway and the fleet simulator import it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0  # the parent of a sequence's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block whose predecessor's hash is ``parent`` (``ROOT`` for the first block)."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    # int32 little-endian; masked, so an id outside int32 (none in a real vocabulary) hashes instead of raising
    h.update(struct.pack(f"<{len(tokens)}I", *(t & 0xFFFFFFFF for t in tokens)))
    return int.from_bytes(h.digest(), "big")


def prefix_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> tuple[int, ...]:
    """The chain over the full blocks of ``token_ids``, continuing from ``parent``: ``len(token_ids) // block_size``
    hashes."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return tuple(out)
