"""The front doors: where a client's bytes come in and an answer goes out.

- ``http_server.py``: the OpenAI-compatible HTTP server (uvicorn, vLLM's OpenAI app, ``/health``, ``/metrics``).
- ``http_middleware.py``: what the HTTP door adds around vLLM's app (the bearer token, the body limit, the ``vtoken``
  extension, admission, disconnects, statuses that survive streaming).
- ``grpc_server.py``: the gRPC server (Generate, GetClusterStatus, Scale, WatchCapacity, health, reflection);
  ``grpc_requests.py`` maps its protobuf onto vLLM's request models.
- ``auth.py``: the bearer token both doors check; ``sockets.py``: their ports (``PortInUse``, ``bind_socket``).

May import: ``cluster/serving/`` (the one request path under both doors), the controller's published views
(``cluster/control/snapshot.py``, ``status.py``, ``capacity.py``), ``cluster/config.py``, ``cluster/proto/``. Never the
control plane's internals (the controller, the replica lifecycle, the autoscaler): a door talks to the controller
through its Ray handle. Nothing below imports a door (tests/test_architecture.py).
"""
