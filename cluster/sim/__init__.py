"""A discrete-event fleet simulator: many replicas, the project's own placement strategies and autoscaler.

- ``calibration.py``: what a replica is made of, measured on the real engine (step times, blocks per forward);
  ``vtoken/bench/calibrate.py`` makes it (``vtoken bench fleet --calibrate``), beside the other benchmarks.
- ``workload.py``: arrivals (Poisson, bursts, a diurnal day) and heavy-tailed request lengths.
- ``replica.py``: one replica: vLLM's scheduler in miniature over a block pool, steps timed by the model.
- ``fleet.py``: the event loop, the controller's promises, ``cluster/placement/strategies.py`` and
  ``cluster/control/autoscaler.py``.
- ``study.py``: the experiments ``vtoken bench fleet`` reports (validation, load sweep, replicas needed, a day).
"""
