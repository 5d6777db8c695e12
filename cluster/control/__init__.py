"""The control plane: the controller actor and what it keeps about the replicas.

- ``controller.py``: the Ray actor that owns the replicas, their reports, the promises and scaling.
- ``lifecycle.py``: creating, starting, probing, restarting and draining replicas, and the one place a replica's
  status changes; ``replica_status.py``: the statuses and their transitions.
- ``autoscaler.py``: when to scale, from the replicas' views.
- ``snapshot.py``: the controller's state in one read; ``status.py`` and ``capacity.py``: what status, the status
  table and the capacity stream make of it (the views the doors and ``/metrics`` read).

May import: ``cluster/placement/``, ``cluster/config.py``, ``cluster/proto/``, ``actors/`` (the replica actor and its
reports). Never the doors nor the request path (tests/test_architecture.py): the gateway reaches the controller
through its Ray handle.
"""
