"""Where a token's life is decided: plain Python and NumPy, on the scheduler's side.

Which tokens die (``policies/``, one ``score()`` each), when a request may decide (``schedule``), what it does then
(``phase``), how many tokens it keeps (``budget``), where each live token sits (``token_table``), which tokens move
so that blocks empty out (``planner``, ``packing``), what is parked outside the pool (``park``) and how it comes
back (``recall``), what the pool gives back under pressure and whom it admits (``pressure``, ``shedding``), what
the worker scores (``score_ask``), the step's decisions for every request (``compactor``, ``request_state``) and
the messages of a step (``step``, ``move_batch``: the one that leaves for the bytes); ``records``, ``replay`` and
``reporting`` keep the audit trail and the figures, ``accounting`` what Naive-Evict would hold.

The compactor keeps a token table's life (decide, pack, plan) and holds two small owners it calls: a ``Recall``
(the tier's slots, choices among live and parked tokens, re-inflation) and a ``Pressure`` (the shortfall, who
sheds, the forecast). Every token that dies, parks or comes back goes through its one compaction.

May import: the standard library, NumPy and ``vtoken.core`` itself. Never torch, Triton, vLLM, ``vtoken.kv``,
``vtoken.vllm_adapter``, ``actors`` or ``cluster`` (tests/test_architecture.py holds this wall), so the decisions
run, and are tested, with no device and no engine.
"""
