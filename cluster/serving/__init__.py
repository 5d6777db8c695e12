"""The request path both doors share, under them: vLLM's serving layer over the replicas, admission, placement, the
stream back, metrics.

- ``frontend.py``: vLLM's OpenAI app and its render-only ``VllmConfig``, built in the gateway without weights.
- ``remote_engine.py``: vLLM's ``EngineClient`` over the replicas; ``requests.py``: a request's ``vtoken`` options,
  its context and the ``ValidRequest`` placed.
- ``dispatch.py``: admission, placement, the replica's stream, retries, aborts; ``work.py``: a request's work, by which
  it is admitted; ``metrics.py``: ``/metrics``.
- ``grammar_pool.py``: structured outputs checked in worker processes; ``template_kwargs.py``: what
  ``chat_template_kwargs`` may set.

May import: ``cluster/placement/`` (the gateway places from its copy of the controller's views), the controller's
published snapshot (``cluster/control/snapshot.py``), ``cluster/config.py``, ``actors/`` (the wire types and the token
channel) and vLLM's public serving layer. Never a door, nor the control plane's internals (tests/test_architecture.py).
"""
