"""vToken: token-level KV-cache virtualization that turns token eviction into freed PagedAttention blocks.

Where things happen, one folder each:
  vtoken/core/          where a token's life is decided (plain Python and NumPy, no torch): the policies, the
                        schedule, budgets, the TokenTable, compaction plans, sheds under pressure, the compactor
  vtoken/kv/            where its bytes move (torch, no vLLM): the byte order of a step, the movers, the KV
                        layout, the parking tier, attention statistics
  vtoken/vllm_adapter/  the one place that knows vLLM's internals (scheduler, worker, model runner, engine)
At the top, what a user touches first: config.py (VTokenConfig), models.py, cli.py, demo.py.
Placed on Ray: actors/ (the replicas), cluster/ (doors, the request path, control plane, placement, CLI).
"""

__version__ = "0.1.0"
