"""Where a token's bytes move: torch (and Triton) tensors, on the worker's side.

The byte order of one step (``worker_step``: fetch, park, move, restore), the movers that carry out a step's
``MoveBatch`` (``mover``: CPU and CUDA; ``fused_mover`` and ``move_kernel``: one Triton kernel; ``mover_factory``
picks), the KV cache's layout as the attention backend writes it (``kv_layout``), the parking tier's K and V
outside the pool (``tier``), and attention statistics for the policies (``scores`` beside its naive reference
``scores_reference``, ``query_window`` for the decode queries).

May import: torch, Triton, NumPy and ``vtoken.core`` (the messages and plans it carries out). Never vLLM: what
knows vLLM's internals lives in ``vtoken.vllm_adapter`` (tests/test_architecture.py holds this wall).
"""
