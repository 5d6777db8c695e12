"""The serving cluster, by floor (each imports only what is on its own floor or below; tests/test_architecture.py):

- ``cli.py``, ``server.py``: `vtoken serve | generate | status | scale`, and starting and stopping a deployment.
- ``doors/``: the HTTP (vLLM's OpenAI app) and gRPC servers, their auth and ports.
- ``serving/``: the request path under both doors (vLLM's serving layer over the replicas, admission, dispatch,
  metrics); ``sim/``: the fleet simulator; ``ray_connect.py``: getting a Ray.
- ``control/``: the controller, the replica lifecycle, the autoscaler, the snapshot that status and metrics read.
- ``config.py``: ``ServeConfig`` (configs/serve.yaml) and the engine arguments every replica and the gateway take.
- ``placement/``: the placement strategies, the gateway's placer, the prefix indexes; ``proto/``: the gRPC API.
"""
