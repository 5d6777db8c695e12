"""vToken: token-level KV-cache virtualization that turns token eviction into freed PagedAttention blocks.

Where things happen:
  vtoken/policies/     which tokens die (eviction policies; a registry keyed by name)
  vtoken/token_table.py  where each live token sits (logical token -> physical slot, per request)
  vtoken/planner.py    which tokens move where so that blocks empty out (compaction plans)
  vtoken/mover.py      where the bytes move (one gather-then-scatter per step, CPU and CUDA)
  vtoken/accounting.py what vToken, Naive-Evict and the floor hold
"""

__version__ = "0.1.0"
