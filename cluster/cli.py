"""`vtoken serve | generate | status | scale`. Only `serve` imports Ray; the others are thin gRPC clients."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys

DEFAULT_SERVER = "127.0.0.1:50051"


def add_cli(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model on Ray behind gRPC and OpenAI-compatible HTTP gateways (Ctrl-C stops cleanly)"
    )
    p.add_argument("--config", required=True, help="serve config, e.g. configs/serve.yaml")
    p.add_argument(
        "--address",
        help="join this Ray cluster: HOST:PORT of its head (the GCS port, 6379 by default), or auto (the one "
        "`ray start` recorded here); default: a local Ray of its own, never one left on the machine",
    )
    p.add_argument("--host", help="override gateway.host")
    p.add_argument("--port", type=int, help="override gateway.port, gRPC (0: any free port)")
    p.add_argument("--http-port", type=_http_port, help="override gateway.http_port (0: no HTTP; any: any free port)")
    p.add_argument("--port-file", help="write the bound gRPC port here once serving")
    p.add_argument("--http-port-file", help="write the bound HTTP port here once serving")
    p.add_argument("--verbose", action="store_true", help="show vLLM's and Ray's logs here instead of in a log file")
    p.set_defaults(func=_serve)

    g = sub.add_parser("generate", help="stream a completion from a running `vtoken serve`")
    g.add_argument("prompt", nargs="?", help="the prompt (or --chat)")
    g.add_argument("--chat", action="append", metavar="ROLE:TEXT", help="a chat message; repeat for several")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--deadline", type=float, help="seconds")
    g.add_argument(
        "--vtoken",
        metavar="JSON",
        help="this request's own eviction options (gRPC VTokenOptions), e.g. '{\"pressure_floor\": 0.5}' or "
        '\'{"policy": "h2o", "budget": 0.25}\'',
    )
    g.add_argument("--json", action="store_true", help="one JSON object with the text and token ids")
    _client_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("status", help="per-replica free/reclaimed/live blocks, running, waiting, scaling")
    s.add_argument("--json", action="store_true")
    _client_args(s)
    s.set_defaults(func=_status)

    c = sub.add_parser("scale", help="set the target number of replicas")
    c.add_argument("replicas", type=int)
    _client_args(c)
    c.set_defaults(func=_scale)


def _http_port(value: str) -> int | str:
    if value == "any":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, 0 or 'any', got {value!r}") from None


def _client_args(p) -> None:
    p.add_argument(
        "--server",
        default=os.environ.get("VTOKEN_SERVER", DEFAULT_SERVER),
        help="gateway host:port (env VTOKEN_SERVER)",
    )
    p.add_argument("--token-env", default="VTOKEN_TOKEN", help="env variable with the bearer token, if any")
    p.add_argument("--ca", help="PEM CA certificate: connect with TLS")


def _stub(args):
    import grpc

    from cluster.proto import vtoken_pb2_grpc as pbg

    if args.ca:
        with open(args.ca, "rb") as f:
            channel = grpc.secure_channel(args.server, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.server)
    token = os.environ.get(args.token_env)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return pbg.VTokenStub(channel), metadata


def _rpc_error(e) -> int:
    print(f"vtoken: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def generate_request(args):
    """``vtoken generate``'s arguments as a ``GenerateRequest``; ValueError names what is wrong."""
    from google.protobuf import json_format

    from cluster.proto import vtoken_pb2 as pb

    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    if args.chat:
        pairs = [m.split(":", 1) if ":" in m else ["user", m] for m in args.chat]
        req.messages.messages.extend(pb.ChatMessage(role=r, content=t) for r, t in pairs)
    elif args.prompt is not None:
        req.prompt = args.prompt
    else:
        raise ValueError("give a prompt or --chat")
    if args.vtoken:
        try:
            json_format.Parse(args.vtoken, req.vtoken)
        except json_format.ParseError as e:
            raise ValueError(f"--vtoken: {e}") from None
    return req


def _generate(args) -> int:
    import grpc

    try:
        req = generate_request(args)
    except ValueError as e:
        print(f"vtoken generate: {e}", file=sys.stderr)
        return 2
    stub, md = _stub(args)
    text, ids, last = [], [], None
    try:
        for msg in stub.Generate(req, metadata=md, timeout=args.deadline):
            last = msg
            text.append(msg.text)
            ids.extend(msg.token_ids)
            if not args.json:
                print(msg.text, end="", flush=True)
    except grpc.RpcError as e:
        return _rpc_error(e)
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "token_ids": ids,
                    "replica": last.replica if last else "",
                    "finish_reason": last.finish_reason if last else "",
                }
            )
        )
    else:
        print()
    return 0


def _status(args) -> int:
    import grpc

    from cluster.control.status import from_proto, render_table
    from cluster.proto import vtoken_pb2 as pb

    stub, md = _stub(args)
    try:
        status = from_proto(stub.GetClusterStatus(pb.ClusterStatusRequest(), metadata=md, timeout=10))
    except grpc.RpcError as e:
        return _rpc_error(e)
    print(json.dumps(status, indent=2) if args.json else render_table(status))
    return 0


def _scale(args) -> int:
    import grpc

    from cluster.proto import vtoken_pb2 as pb

    stub, md = _stub(args)
    try:
        r = stub.Scale(pb.ScaleRequest(replicas=args.replicas), metadata=md, timeout=10)
    except grpc.RpcError as e:
        return _rpc_error(e)
    print(f"target replicas: {r.target_replicas}")
    return 0


def _serve(args) -> int:
    import logging

    from cluster.config import ConfigError, load_config, parse_config, preflight
    from cluster.server import check_ports

    # Everything that can be wrong with the config or this machine is found here, before Ray starts: one line
    # naming the field and the fix, exit code 2.
    try:
        cfg = load_config(args.config)
        flags = {"host": args.host, "port": args.port, "http_port": args.http_port}
        if any(v is not None for v in flags.values()):
            gw = cfg.gateway.model_dump() | {k: v for k, v in flags.items() if v is not None}
            cfg = parse_config(cfg.model_dump() | {"gateway": gw}, source=f"{args.config} with the command's flags")
        preflight(cfg, local=not (args.address or cfg.ray.address))
        check_ports(cfg)
    except (ConfigError, ValueError) as e:
        print(f"vtoken serve: {e}", file=sys.stderr)
        return 2
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    else:
        print(
            f"vtoken: library logs go to {args.log_file}, the replicas' to Ray's session logs "
            "(/tmp/ray/session_latest/logs by default); --verbose shows them here",
            flush=True,
        )
    local = not (args.address or cfg.ray.address)
    print("vtoken: starting Ray" if local else f"vtoken: joining Ray at {args.address or cfg.ray.address}", flush=True)
    code = _start_ray(cfg, args)
    if code is not None:
        return code
    try:
        return asyncio.run(_serve_async(cfg, args, local))
    except KeyboardInterrupt:  # between Ray's start and our signal handlers
        print("vtoken serve: interrupted during start-up; stopped", file=sys.stderr)
        return 130


def _start_ray(cfg, args) -> int | None:
    """Ray started or joined (None), or the exit code after one line saying why not. In the main thread, before
    the event loop: Ray's start waits in short joins (cluster/ray_connect.py), so Ctrl-C and the deadline are
    heard at once even while ``ray.init`` is stuck inside Ray's C++ client. Such a stuck call cannot be undone
    or waited for, so these two ways out end the process at once (``os._exit``) instead of running Ray's atexit
    shutdown against a half-made connection; a local Ray's processes die with us (Ray starts them so)."""
    from cluster.ray_connect import RayUnavailable, connect

    def interrupted(signum, frame):
        # Ended from the handler itself: a KeyboardInterrupt raised inside a library's code (Ray's import, gRPC)
        # could be caught there and the start go on; a test saw one Ctrl-C unheard for 15 s in a full CI run.
        print("vtoken serve: interrupted while starting Ray; stopped", file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        print(f"vtoken: {connect(cfg, args.address, verbose=args.verbose)}", flush=True)
        return None
    except RayUnavailable as e:
        print(f"vtoken serve: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("vtoken serve: interrupted while starting Ray; stopped", file=sys.stderr, flush=True)
        code = 130
    finally:
        signal.signal(signal.SIGINT, previous)
    import logging

    logging.shutdown()
    os._exit(code)


async def _watch_replicas(controller, every_s: float = 2.0) -> None:
    """Our own progress while serving: a line whenever a replica changes state (dies, serves again) and where it
    runs, and when the controller stops answering (Ray restarts it) and answers again."""
    states: dict[str, tuple[str, int]] = {}  # name -> (state, pid)
    lost_at: float | None = None
    pid = None  # the controller's process: a new one is a restart, even one quicker than a poll
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every_s)
        try:
            st = await asyncio.wait_for(controller.status.remote(), 10)
        except Exception as e:  # restarting (or stopping): say so once
            if lost_at is None:
                lost_at = loop.time()
                print(f"vtoken: the controller is not answering ({type(e).__name__}); Ray restarts it", flush=True)
            continue
        rows = st["replicas"]
        if lost_at is not None or pid not in (None, st["controller_pid"]):
            serving = sum(r["state"] == "healthy" for r in rows)
            after = f" after {loop.time() - lost_at:.0f}s" if lost_at is not None else ""
            print(f"vtoken: the controller answers again{after} (restarted, pid {st['controller_pid']}); it took over "
                  f"{len(rows)} replicas, {serving} serving", flush=True)  # fmt: skip
            lost_at = None
        pid = st["controller_pid"]
        now = {r["name"]: (r["state"], r.get("pid", 0)) for r in rows}
        for r in rows:
            was = states.get(r["name"])
            if not states or was == now[r["name"]] or (was and was[0] == r["state"] and not r.get("pid")):
                continue
            where = f" (node {r['node_ip']} {r['node_id'][:8]}, pid {r['pid']})" if r.get("pid") else ""
            # the same state in another process: it died and came back between two looks
            how = f"restarted, {r['state']}" if was and was[0] == r["state"] else r["state"]
            print(f"vtoken: replica {r['name']} is {how}{where}", flush=True)
        states = now


class StartProgress:
    """`vtoken serve`'s start on the console: a line whenever a replica moves (placed and loading its engine on a
    node, healthy, failed with vLLM's own reason), and every ``every_s`` how many serve, with the time waited."""

    def __init__(self, replicas: int, every_s: float = 15.0, out=None):
        self.replicas, self.every_s, self.out = replicas, every_s, out or sys.stdout
        self.seen: dict[str, str] = {}
        self.said_at = 0.0

    def __call__(self, rows: list[dict[str, str]], elapsed: float) -> None:
        for r in rows:
            state = r["state"]
            what = {"starting": r["phase"], "failed": f"failed: {r['error']}"}.get(state, state)
            if self.seen.get(r["name"]) != what:
                self.seen[r["name"]] = what
                self.said_at = elapsed
                print(f"vtoken: replica {r['name']}: {what} ({elapsed:.0f}s)", file=self.out, flush=True)
        if elapsed - self.said_at >= self.every_s:
            self.said_at = elapsed
            healthy = sum(r["state"] == "healthy" for r in rows)
            print(f"vtoken: waiting for replicas: {healthy} of {self.replicas} healthy ({elapsed:.0f}s)",
                  file=self.out, flush=True)  # fmt: skip


async def _serve_async(cfg, args, local: bool) -> int:
    import ray

    from cluster.server import serving

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"vtoken: starting {cfg.replicas} replicas of {cfg.model}; Ctrl-C stops", flush=True)
    started = asyncio.Event()

    async def serve():
        async with serving(cfg, local=local, progress=StartProgress(cfg.replicas)) as s:
            started.set()
            # The start-up heap (vLLM's config, the tokenizer, Ray) marked static, as vLLM's own server does after its
            # start (vllm/entrypoints/launchers/utils/server_utils.py): the garbage collector's full passes then walk
            # only what requests made, and pause the event loop for less. Here, in the process `vtoken serve` owns,
            # not in serving(), which tests and benchmarks run inside processes of their own (BackgroundServer).
            gc.collect()
            gc.freeze()
            g = cfg.gateway
            scheme = "https" if g.tls_cert else "http"
            http = f", OpenAI API {scheme}://{g.host}:{s.http_port}/v1" if s.http_port else ""
            print(
                f"vtoken: serving {cfg.model_name}: gRPC {g.host}:{s.port}{http} ({cfg.replicas} replicas, "
                f"placement {cfg.placement.strategy}); Ctrl-C stops",
                flush=True,
            )
            for path, port in ((args.port_file, s.port), (args.http_port_file, s.http_port)):
                if path and port:
                    with open(path + ".tmp", "w") as f:
                        f.write(str(port))
                    os.replace(path + ".tmp", path)
            watcher = asyncio.ensure_future(_watch_replicas(s.controller))
            await stop.wait()
            watcher.cancel()
            print("vtoken: shutting down: draining replicas", flush=True)
        return s

    task = asyncio.ensure_future(serve())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set() and not task.done():
            # Ctrl-C while replicas start (that can take the whole start timeout): stop now; serving()'s
            # cleanup kills the controller and the replicas started so far.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            print("vtoken serve: interrupted during start-up; stopped", file=sys.stderr, flush=True)
            return 130
        try:
            s = await task
        except (ValueError, OSError, RuntimeError) as e:  # a failed start: the reason, not a traceback
            print(f"vtoken serve: {e}", file=sys.stderr, flush=True)
            return 2 if isinstance(e, ValueError | OSError) else 1
        except ray.exceptions.RayError as e:  # the controller lost during start-up
            print(f"vtoken serve: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return 1
        free = [f"{r.name} {r.pool.free_blocks}/{r.pool.total_blocks}" for r in s.final_reports]
        drained = f"free blocks after drain: {', '.join(free)}" if free else "no replica reported after its drain"
        print(f"vtoken: stopped; {drained}", flush=True)
        return 0
    finally:
        stopped.cancel()
        if not task.done():  # cancelled from outside: serving()'s cleanup needs Ray, so it runs first
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if local:
            ray.shutdown()
