"""Where a token's life is decided: plain Python and NumPy, on the scheduler's side.

Which tokens die (``policies/``, one ``score()`` each), when a request may decide (``schedule``), what it does then
(``phase``), how many tokens it keeps (``budget``), where each live token sits (``token_table``), which tokens move
so that blocks empty out (``planner``, ``packing``), what the pool gives back under pressure (``shedding``), what is
parked outside the pool (``park``), the step's decisions for every request (``compactor``, ``request_state``) and
the one message that leaves for the bytes (``move_batch``); ``records`` and ``replay`` keep the audit trail.

May import: the standard library, NumPy and ``vtoken.core`` itself. Never torch, Triton, vLLM, ``vtoken.kv``,
``vtoken.vllm_adapter``, ``actors`` or ``cluster`` (tests/test_architecture.py holds this wall), so the decisions
run, and are tested, with no device and no engine.
"""
