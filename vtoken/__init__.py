"""vToken: token-level KV-cache virtualization that turns token eviction into freed PagedAttention blocks.

Where things happen. Decide (plain Python and NumPy, no torch):
  vtoken/policies/       which tokens die (what: one score() each; a registry keyed by name)
  vtoken/schedule.py     when a request may evict (the policies never decide when)
  vtoken/phase.py        what a request does at that point (keeping, reading, choosing, decoding)
  vtoken/budget.py       how many tokens it keeps, and the blocks that holds
  vtoken/compactor.py    the decisions of each step, and the compaction that follows them
  vtoken/token_table.py  where each live token sits (logical token -> physical slot, per request)
  vtoken/planner.py      which tokens move where so that blocks empty out (compaction plans)
  vtoken/move_batch.py   the message to the bytes: one step's moves
Move (torch, no vLLM):
  vtoken/worker_step.py  the byte order of one step (fetch, park, move, restore)
  vtoken/mover.py        where the bytes move (one Mover interface; CPU, CUDA, fused Triton)
  vtoken/tier.py         parked tokens' K and V outside the pool
Inside vLLM: vtoken/vllm_adapter/. Placed on Ray: actors/, cluster/.
"""

__version__ = "0.1.0"
