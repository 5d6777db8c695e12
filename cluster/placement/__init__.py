"""Where a request goes: decided from views of the replicas alone, in the controller, in a gateway and in the fleet
simulator alike.

- ``strategies.py``: the placement strategies (chosen by name from ``STRATEGIES``), ``ReplicaView`` and the fit check.
- ``placer.py``: placement in the gateway, from its copy of the controller's views.
- ``prefix_index.py``: what each replica's prefix cache holds, as the controller and the gateways' copies know it.

The ground floor of ``cluster/``: imports nothing of it (no door, no request path, no controller, no config), only
``actors/report.py``'s types (tests/test_architecture.py).
"""
