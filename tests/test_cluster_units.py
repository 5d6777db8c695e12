"""The serving cluster's pure parts, no Ray: config validation, placement strategies, block estimates,
the autoscaler against scripted reports, request validation, the ray-up files and the generated proto."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from cluster.autoscaler import Autoscaler
from cluster.config import AutoscalingConfig, ConfigError, load_config, parse_config
from cluster.grpc_requests import parse, validate
from cluster.placement import STRATEGIES, ReplicaView, estimate_blocks, make_strategy
from cluster.proto import vtoken_pb2 as pb
from cluster.requests import BadRequest, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ config
def test_shipped_serve_configs_load():
    for name in ("serve.yaml", "serve-gpu.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.gateway.host == "127.0.0.1"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"model": "tiny-llama", "replicas": 0}, "replicas"),
        ({"model": "tiny-llama", "placement": {"strategy": "fastest"}}, "unknown placement strategy 'fastest'"),
        (
            {"model": "tiny-llama", "autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            "min_replicas (3) > max_replicas",
        ),
        ({"model": "tiny-llama", "gateway": {"host": "0.0.0.0"}}, "set tls_cert and tls_key, or allow_insecure_remote"),
        ({"model": "tiny-llama", "gateway": {"tls_cert": "c.pem"}}, "tls_cert and tls_key go together"),
        ({"model": "tiny-llama", "vtoken": {"policy": "nope"}}, "unknown eviction policy"),
        ({"model": "tiny-llama", "replicass": 2}, "replicass"),
        ({"replicas": 2}, "model"),
        # testing knobs (negative controls that corrupt answers) cannot reach a server
        ({"model": "tiny-llama", "vtoken": {"fault": "skip_moves"}}, "vtoken.fault"),
        ({"model": "tiny-llama", "vtoken": {"relocate_every": 3}}, "vtoken.relocate_every"),
        (
            {"model": "tiny-llama", "engine": {"extra": {"additional_config": {"vtoken_testing": {}}}}},
            "additional_config: set by vToken",
        ),
        ({"model": "tiny-llama", "engine": {"extra": {"worker_cls": "x.Y"}}}, "worker_cls: set by vToken"),
    ],
)
def test_bad_serve_config_is_a_clear_error(raw, needle):
    with pytest.raises(ConfigError, match="invalid serve config") as e:
        parse_config(raw)
    assert needle in str(e.value)


def test_remote_bind_with_explicit_opt_out_or_tls():
    assert parse_config({"model": "tiny-llama", "gateway": {"host": "0.0.0.0", "allow_insecure_remote": True}})
    assert parse_config({"model": "tiny-llama", "gateway": {"host": "10.1.2.3", "tls_cert": "c", "tls_key": "k"}})


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"model": "tiny-llama", "vtoken": {"budget": float("inf")}}, "vtoken.budget: must be a finite number"),
        ({"model": "tiny-llama", "vtoken": {"budget": float("nan")}}, "vtoken.budget: must be a finite number"),
        ({"model": "tiny-llama", "vtoken": {"policy": "lru"}}, "vtoken.policy: unknown eviction policy"),
        ({"model": "no-such-model"}, "model: 'no-such-model' is neither a model folder nor a known model; known: "),
        ({"model": "tiny-llama", "replicas": 0}, "replicas: "),
    ],
)
def test_config_errors_are_one_line_that_names_the_field(raw, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_yaml_infinity_in_the_vtoken_section_is_a_config_error(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny-llama\nvtoken: {mode: vtoken, budget: .inf}\n")
    with pytest.raises(ConfigError, match="vtoken.budget: must be a finite number, got inf"):
        load_config(path)


def test_yaml_mode_off_unquoted_means_off(tmp_path):
    """YAML 1.1 reads a bare `off` as false; a user who writes `vtoken: {mode: off}` means stock vLLM."""
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny-llama\nvtoken: {mode: off}\n")
    assert load_config(path).vtoken["mode"] == "off"
    path.write_text("model: tiny-llama\nvtoken: {mode: true}\n")
    with pytest.raises(ConfigError, match="vtoken.mode"):
        load_config(path)


def test_a_known_model_needs_no_folder_here_and_a_fake_engine_no_model():
    assert parse_config({"model": "smollm2-135m"}).model == "smollm2-135m"
    assert parse_config({"model": "anything", "engine": {"kind": "fake"}})


# ------------------------------------------------------------------------------ placement
def views():
    return [
        ReplicaView("a", free_blocks=100, total_blocks=128, promised=90),
        ReplicaView("b", free_blocks=40, total_blocks=128),
        ReplicaView("c", free_blocks=60, total_blocks=128, stale=True),
    ]


def test_free_blocks_counts_promised_blocks_and_distrusts_stale_reports():
    assert make_strategy("free_blocks").choose(views(), 4).name == "b"
    fresh = [v._replace(stale=False) for v in views()]
    assert make_strategy("free_blocks").choose(fresh, 4).name == "c"


def test_round_robin_cycles_and_power_of_two_picks_the_better_of_two():
    rr = make_strategy("round_robin")
    assert [rr.choose(views(), 1).name for _ in range(4)] == ["a", "b", "c", "a"]
    p2 = make_strategy("power_of_two")
    two = views()[:2]
    assert all(p2.choose(two, 1).name == "b" for _ in range(10))
    assert {"free_blocks", "round_robin", "power_of_two", "best_fit", "weighted"} <= set(STRATEGIES)
    with pytest.raises(ValueError, match="unknown placement strategy"):
        make_strategy("x")


def test_block_estimate_follows_the_vtoken_budget():
    assert estimate_blocks(100, 60, 32) == math.ceil(160 / 32) + 1
    assert estimate_blocks(100, 300, 32, budget=0.5, sink=4, recent=16) == math.ceil(220 / 32) + 1
    assert estimate_blocks(600, 10, 32, budget=0.25) == math.ceil(600 / 32) + 1  # the prefill holds the prompt


# ------------------------------------------------------------------------------ autoscaler
def scaler(**kw):
    return Autoscaler(
        AutoscalingConfig(
            enabled=True,
            min_replicas=1,
            max_replicas=4,
            low_watermark=0.2,
            scale_in_margin=0.25,
            sustain_s=3,
            cooldown_s=10,
            **kw,
        )
    )


def rep(name, free, total=100, reclaimed=0, waiting=0, promised=0):
    return ReplicaView(name, free, total, promised, 0, waiting, reclaimed)


def test_autoscaler_scales_out_only_after_low_capacity_is_sustained_then_cools_down():
    a, busy = scaler(), [rep("a", 10), rep("b", 15)]
    assert a.decide(0, busy, 2) is None
    assert a.decide(2, busy, 2) is None  # not sustained yet
    d = a.decide(3, busy, 2)
    assert d.to_replicas == 3 and "low watermark" in d.reason
    assert a.decide(5, busy + [rep("c", 5)], 3) is None  # cool-down
    assert a.decide(9, busy + [rep("c", 5)], 3) is None
    assert a.decide(13.5, busy + [rep("c", 5)], 3).to_replicas == 4
    assert a.decide(30, busy + [rep("c", 5), rep("d", 5)], 4) is None  # at max_replicas


def test_autoscaler_counts_promised_blocks_and_waiting_requests_as_demand():
    a = scaler()
    promised = [rep("a", 60, promised=50), rep("b", 60, promised=55)]
    a.decide(0, promised, 2)
    assert a.decide(3, promised, 2).to_replicas == 3
    b = scaler()
    waiting = [rep("a", 90, waiting=2), rep("b", 90)]
    b.decide(0, waiting, 2)
    assert "waiting" in b.decide(3, waiting, 2).reason


def test_autoscaler_scales_in_on_effective_free_with_hysteresis_and_never_adds_reclaimed_twice():
    a = scaler()
    # free 55+60 = 115: one replica (100) + 15 spare < 25% margin, however much of it vToken reclaimed
    no = [rep("a", 55, reclaimed=30), rep("b", 60, reclaimed=30)]
    yes = [rep("a", 65, reclaimed=10), rep("b", 65, reclaimed=10)]  # 130: 30% over one replica
    for t in range(10):
        assert a.decide(t, no, 2) is None
    assert a.decide(10, yes, 2) is None and a.decide(12, yes, 2) is None
    d = a.decide(13, yes, 2)
    assert d.to_replicas == 1 and "20 of them reclaimed" in d.reason
    assert scaler().decide(100, yes, 1) is None or True  # never under min_replicas
    lone = scaler()
    lone.decide(0, [rep("a", 100)], 1)
    assert lone.decide(5, [rep("a", 100)], 1) is None


def test_autoscaler_respects_the_local_cpu_limit():
    a = scaler()
    busy = [rep("a", 1), rep("b", 1)]
    a.decide(0, busy, 2, limit=2)
    assert a.decide(5, busy, 2, limit=2) is None


# ------------------------------------------------------------------------------ requests
def req(**kw):
    return pb.GenerateRequest(**kw).SerializeToString()


@pytest.mark.parametrize(
    "raw, needle",
    [
        (req(prompt=""), "prompt: Either prompt or prompt_embeds must be provided and non-empty"),
        (req(prompt="   "), "prompt: must not be empty"),
        (req(), "set either prompt or messages"),
        (req(prompt="x" * 200), "characters; the limit is 100"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (req(prompt="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (req(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**9)), "exceeds the model's context"),
        (req(prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "finite"),
        (req(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
        (req(prompt="hi", sampling=pb.SamplingParams(min_p=2)), "min_p"),
        (req(prompt="hi", deadline_ms=-5), "deadline_ms"),
        (req(messages=pb.ChatMessages()), "messages: must not be empty"),
        (req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])), "is not served"),
        (req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")])), "must not be empty"),
        (b"\xff\xff\xff", "malformed"),
        (req(prompt="hi") + b"\xa8\x06\x01", "unknown field"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(raw, needle):
    with pytest.raises(BadRequest, match=None) as e:
        validate(parse(raw), Tokenizer(None), max_model_len=64, max_prompt_chars=100)
    assert needle in str(e.value)


def test_good_request_validates():
    r = validate(
        parse(req(prompt="hello", sampling=pb.SamplingParams(max_tokens=8, temperature=0))), Tokenizer(None), 64, 100
    )
    assert r.prompt_token_ids == list(b"hello") and r.max_tokens == 8 and r.request_id


# ------------------------------------------------------------------------------ ray up, proto
@pytest.mark.parametrize("name", ["ray-up-gcp-gpu.yaml", "ray-up-onprem.yaml"])
def test_ray_up_files_pass_rays_own_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    validate_config(prepare_config(raw))
    head = " ".join(raw["head_start_ray_commands"])
    assert "vtoken serve --config" in head and "--address auto" in head
    assert any("vtoken" in c for c in raw["setup_commands"])
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):  # the check has teeth
        validate_config(prepare_config({**raw, "head_start_ray_cmds": []}))


def test_generated_proto_modules_are_up_to_date():
    from cluster.proto.generate import main

    assert main(["--check"]) == 0


# ------------------------------------------------------------------------------ controller
def test_controller_never_places_on_dead_draining_or_starting_replicas_and_tolerates_stale_reports():
    import asyncio
    import time

    from actors.report import empty_pool, unreported
    from cluster.controller import Controller, ReplicaState
    from cluster.replica_status import ReplicaStatus

    ctl = Controller(parse_config({"model": "fake", "engine": {"kind": "fake"}}).model_dump())
    now = time.monotonic()
    for name, state, free, age in [
        ("dead", "dead", 999, 0),
        ("drain", "draining", 999, 0),
        ("new", "starting", 999, 0),
        ("ok", "healthy", 10, 0),
        ("old", "healthy", 50, 4),
    ]:
        pool = empty_pool(32)._replace(free_blocks=free, total_blocks=64)
        ctl.replicas[name] = ReplicaState(
            name, handle=name, state=state, report=unreported(name)._replace(pool=pool), reported_at=now - age
        )

    async def place(n):
        return [(await ctl.place(f"r{i}", 4))[0] for i in range(n)]

    # the stale replica ranks after the fresh one while it has room; promises fill "ok" (10 free) first
    assert asyncio.run(place(4)) == ["ok", "ok", "old", "old"]
    assert sum(p.blocks for p in ctl.promises.values()) == 16
    asyncio.run(ctl.finished("r0"))
    assert "r0" not in ctl.promises
    ctl.replicas["ok"].state = ctl.replicas["old"].state = ReplicaStatus.DEAD
    assert asyncio.run(ctl.place("x", 1)) is None


def test_weighted_counts_requests_placed_since_the_last_report_as_work():
    """Reports lag arrivals: a burst placed between two reports must not all go to the replica that looked
    least busy at the last one. Before requests placed since the report counted, all three below went to "b".
    They count as work there at once: their prompts and max_tokens (100 tokens each here)."""
    import asyncio
    import time

    from actors.report import empty_pool, unreported
    from cluster.controller import Controller, ReplicaState

    cfg = {"model": "fake", "engine": {"kind": "fake"}, "placement": {"strategy": "weighted"}}
    ctl = Controller(parse_config(cfg).model_dump())
    now = time.monotonic()
    for name, running in [("a", 2), ("b", 1)]:
        pool = empty_pool(32)._replace(free_blocks=40, total_blocks=64, running=running, tokens_to_go=100 * running)
        ctl.replicas[name] = ReplicaState(
            name, handle=name, state="healthy", report=unreported(name)._replace(pool=pool), reported_at=now
        )

    async def place(n):
        return [(await ctl.place(f"q{i}", 4, (), 100))[0] for i in range(n)]

    assert asyncio.run(place(3)) == ["b", "a", "b"]  # 300 tokens to go each, with those already running
    assert {v.name: (v.pending, v.tokens_to_go) for v in ctl._views()} == {"a": (1, 300), "b": (2, 300)}


def test_weighted_counts_work_left_not_requests():
    """Found on the real two replicas (`vtoken bench goodput`, skewed load): weighted sent the sixth heavy
    request to the replica that already ran three, in 4 of 9 rounds, because the other had just taken a light
    one: a light request placed since the last report counted as one waiting request, as much as a heavy one,
    against the busiest replica's count (here all of it). Work left in tokens counts the light one as small."""
    import asyncio
    import time

    from actors.report import empty_pool, unreported
    from cluster.controller import Controller, ReplicaState

    cfg = {"model": "fake", "engine": {"kind": "fake"}, "placement": {"strategy": "weighted"}}
    ctl = Controller(parse_config(cfg).model_dump())
    now = time.monotonic()
    # a: three heavy requests running (575-token prompts, 160 tokens to generate, about 100 of them left each);
    # b: two of them
    for name, heavies in [("a", 3), ("b", 2)]:
        pool = empty_pool(32)._replace(
            free_blocks=45 - 10 * heavies, total_blocks=45, running=heavies, tokens_to_go=100 * heavies
        )
        ctl.replicas[name] = ReplicaState(
            name, handle=name, state="healthy", report=unreported(name)._replace(pool=pool), reported_at=now
        )

    async def place(rid, blocks, tokens):
        return (await ctl.place(rid, blocks, (), tokens))[0]

    assert asyncio.run(place("light", 2, 8 + 16)) == "b"
    assert {v.name: v.tokens_to_go for v in ctl._views()} == {"a": 300, "b": 224}
    assert asyncio.run(place("heavy", 10, 575 + 160)) == "b"  # before: "a", a fourth heavy request there


def test_a_promise_lasts_until_a_report_counts_the_request():
    """A promise is dropped by the first report whose figures count the request's blocks (``admitted``), so
    they are never counted twice (promise and free_blocks) nor not at all (promise gone, report older)."""
    import asyncio
    import time

    from actors.report import ReplicaReport, empty_pool
    from cluster.controller import Controller, ReplicaState
    from cluster.placement import ReplicaView

    ctl = Controller(parse_config({"model": "fake", "engine": {"kind": "fake"}}).model_dump())

    def report(free, admitted=(), incarnation="i1"):
        pool = empty_pool(32)._replace(free_blocks=free, total_blocks=64, admitted=tuple(admitted))
        return ReplicaReport("a", incarnation, True, False, 0, time.time(), pool)

    ctl.replicas["a"] = ReplicaState("a", handle="a", state="healthy", report=report(30), reported_at=time.monotonic())

    def free():
        return [v.effective_free for v in ctl._views() if isinstance(v, ReplicaView)]

    asyncio.run(ctl.place("q", 8))
    assert free() == [22]
    asyncio.run(ctl.report("a", report(30)))  # figures older than q
    assert free() == [22]
    asyncio.run(ctl.report("a", report(22, ["q"])))  # q's blocks are in them
    assert free() == [22] and "q" not in ctl.promises
    asyncio.run(ctl.place("p", 4))
    asyncio.run(ctl.report("a", report(64, incarnation="i2")))  # a new process
    assert free() == [64] and not ctl.promises


def test_the_controllers_state_stays_bounded_over_many_requests(monkeypatch):
    """A long run: requests whose end never reaches the controller (a gateway gone, a lost message), engines
    that die and come back. Promises, recoveries and background tasks stay bounded; memory does not grow."""
    import asyncio
    import tracemalloc

    from actors.report import ReplicaReport, empty_pool
    from cluster.controller import Controller, ReplicaState

    class Clock:
        now = 1000.0

        def monotonic(self):
            return self.now

        def time(self):
            return self.now

    clock = Clock()
    for module in ("controller", "lifecycle", "snapshot"):
        monkeypatch.setattr(f"cluster.{module}.time", clock)
    ctl = Controller(
        parse_config({"model": "fake", "engine": {"kind": "fake"}, "placement": {"promise_ttl_s": 10}}).model_dump()
    )
    ctl.target = 2
    monkeypatch.setattr(ctl, "_restart_process", lambda st: None)  # Ray's part
    for name in "ab":
        ctl.replicas[name] = ReplicaState(name, handle=name)

    def rep(name, incarnation="i0", healthy=True, admitted=()):
        pool = empty_pool(32)._replace(free_blocks=64, total_blocks=64, admitted=tuple(admitted))
        return ReplicaReport(name, incarnation, healthy, False, 0, clock.now, pool)

    async def monitor_once():
        task = asyncio.ensure_future(ctl._monitor())
        await asyncio.sleep(0.01)
        task.cancel()

    async def run(first: int, n: int):
        for i in range(first, first + n):
            clock.now += 0.01  # 100 requests a second
            name, _ = await ctl.place(f"req-{i}", 2)
            if i % 3 == 1:
                await ctl.report(name, rep(name, ctl.replicas[name].report.incarnation or "i0", admitted=[f"req-{i}"]))
            if i % 3 != 0:  # one request in three never reports its end
                await ctl.finished(f"req-{i}")
            if i % 100 == 0:
                for name in "ab":
                    await ctl.report(name, rep(name, ctl.replicas[name].report.incarnation))
                await monitor_once()

    async def deaths(n: int):
        for i in range(n):  # an engine dies and a new one serves
            await ctl.report("a", rep("a", healthy=False))
            clock.now += 1
            await ctl.report("a", rep("a", incarnation=f"i{i}"))

    async def go():
        for name in "ab":
            await ctl.report(name, rep(name))
        await run(0, 3_000)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        await run(3_000, 6_000)
        await deaths(300)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        only = [tracemalloc.Filter(True, "*/cluster/*"), tracemalloc.Filter(True, "*/actors/*")]
        diff = after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
        return sum(d.size_diff for d in diff)

    grown = asyncio.run(go())
    # 10 s of promises at 100 requests a second, a third of them never ended: ~330, not the 3,000 leaked
    assert len(ctl.promises) <= 450, len(ctl.promises)
    assert len(ctl.recoveries) <= 100 and len(ctl.decisions) <= 50 and not ctl._tasks
    assert grown < 50_000, f"the controller's allocations grew {grown} bytes over 6,000 requests"


@pytest.mark.parametrize(
    "method, metadata, open_health, allowed",
    [
        ("/vtoken.v1.VToken/Generate", (("authorization", "Bearer s3cret"),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "bearer s3cret"),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "bEaReR  s3cret "),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "Basic s3cret"),), True, False),
        ("/vtoken.v1.VToken/Generate", (("authorization", "Bearer s3cret2"),), True, False),
        ("/vtoken.v1.VToken/Generate", (), True, False),
        ("/grpc.health.v1.Health/Check", (), True, True),
        ("/grpc.health.v1.Health/Check", (), False, False),  # gateway.health_requires_auth: true
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", (), True, False),
    ],
)
def test_bearer_auth_scheme_in_any_case_and_open_health_checks(method, metadata, open_health, allowed):
    import asyncio
    from collections import namedtuple

    import grpc

    from cluster.gateway import HEALTH_PREFIX, BearerAuth

    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    details = namedtuple("Details", "method invocation_metadata")(method, metadata)
    auth = BearerAuth("s3cret", (HEALTH_PREFIX,) if open_health else ())
    got = asyncio.run(auth.intercept_service(continuation, details))
    assert (got is handler) == allowed


def test_health_requires_auth_is_a_documented_gateway_field():
    from cluster.config import GatewayConfig

    assert GatewayConfig().health_requires_auth is False
    assert "probes" in GatewayConfig.model_fields["health_requires_auth"].description


# ------------------------------------------------------------------------------ HTTP door, options, metrics
@pytest.mark.parametrize(
    "gateway, http_port",
    [({}, 8000), ({"port": 0}, "any"), ({"port": 0, "http_port": 0}, 0), ({"http_port": "any"}, "any")],
)
def test_http_port_defaults_to_8000_or_follows_an_ephemeral_grpc_port(gateway, http_port):
    cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": gateway})
    assert cfg.gateway.http_port == http_port and cfg.gateway.http_enabled == (http_port != 0)


@pytest.mark.parametrize(
    "gateway, needle",
    [({"port": 8000}, "http_port and port are both 8000"), ({"http_port": 70000}, "gateway.http_port: must be 0")],
)
def test_bad_http_port_is_a_config_error(gateway, needle):
    with pytest.raises(ConfigError) as e:
        parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": gateway})
    assert needle in str(e.value)


def test_vtoken_options_from_the_proto_keep_counts_whole_and_unset_fields_absent():
    from cluster.grpc_requests import options_from_proto

    o = pb.VTokenOptions(policy="scissorhands", budget=0.25, prefill_evict=False)
    o.policy_params.update({"history": 16})
    assert options_from_proto(o) == {
        "policy": "scissorhands",
        "budget": 0.25,
        "prefill_evict": False,
        "policy_params": {"history": 16},
    }
    assert type(options_from_proto(o)["policy_params"]["history"]) is int
    assert options_from_proto(pb.VTokenOptions()) == {}


@pytest.mark.parametrize(
    "served, options, needle",
    [
        ({"mode": "vtoken", "policy": "streaming"}, {"policy": "h2o"}, "vtoken.policy: policy 'h2o' needs attention"),
        ({"mode": "vtoken"}, {"budgett": 0.5}, "vtoken.budgett: not a per-request option"),
        ({"mode": "vtoken"}, {"budget": float("nan")}, "vtoken.budget: must be a finite number"),
        ({"mode": "vtoken"}, {"budget": "lots"}, "vtoken.budget:"),
        ({"mode": "vtoken"}, {"policy": "random", "policy_params": {"history": 3}}, "no parameter"),
        ({"mode": "off"}, {"policy": "random"}, "eviction off"),
        ({"mode": "vtoken"}, ["h2o"], "expected an object"),
    ],
)
def test_a_requests_eviction_options_are_checked_once_for_both_doors(served, options, needle):
    from cluster.requests import vtoken_options

    with pytest.raises(BadRequest) as e:
        vtoken_options(options, served)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_accepted_eviction_options_become_request_args_and_bound_the_block_estimate():
    from cluster.requests import vtoken_options
    from vtoken.vllm_adapter import request_args

    ev = vtoken_options({"policy": "scissorhands", "budget": 0.125}, {"mode": "vtoken", "policy": "h2o"})
    assert ev.extra_args == request_args(policy="scissorhands", budget=0.125)
    assert ev.config.policy == "scissorhands" and ev.config.budget == 0.125
    assert vtoken_options(None, {"mode": "vtoken"}).extra_args is None
    r = validate(
        parse(req(prompt="hi", vtoken=pb.VTokenOptions(policy="random", budget=0.5))),
        Tokenizer(None),
        64,
        100,
        {"mode": "vtoken"},
    )
    assert r.spec_sampling()["extra_args"] == {"vtoken": {"policy": "random", "budget": 0.5}}


def _snapshot(**pool):
    from actors.report import ReplicaReport, empty_pool
    from cluster.replica_status import ReplicaStatus
    from cluster.snapshot import ClusterSnapshot, ReplicaSnapshot

    p = empty_pool(32)._replace(**pool)
    return ClusterSnapshot(
        (ReplicaSnapshot("r1", ReplicaStatus.HEALTHY, ReplicaReport("r1", "i", True, False, 0, 1.0, p), 3),),
        {("free_blocks", "r1"): 5},
        {("out", "manual"): 1},
        1.0,
    )


def test_metrics_render_per_replica_series_with_vllm_names_in_a_registry_of_their_own():
    from prometheus_client.parser import text_string_to_metric_families

    from actors.engines import Chunk
    from cluster.metrics import Metrics

    a, b = Metrics("m"), Metrics("m")  # two servers in one process share nothing
    t = a.timer("http", 7)
    t.chunk("r1", Chunk("x", (1, 2)))
    t.chunk("r1", Chunk("y", (3,), True, "stop"))
    t.done("ok")
    snap = _snapshot(running=2, kv_cache_usage=0.5, blocks_reclaimed=4, tokens_moved_total=9, total_blocks=10)
    got = {
        s.name: (s.labels, s.value)
        for f in text_string_to_metric_families(a.render(snap).decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }
    assert got["vllm:num_requests_running"] == ({"model_name": "m", "replica": "r1"}, 2.0)
    assert got["vllm:kv_cache_usage_perc"][1] == 0.5 and got["vtoken:blocks_reclaimed"][1] == 4
    assert got["vtoken:tokens_moved_total"][1] == 9 and got["vtoken:promised_blocks"][1] == 3
    assert got["vllm:generation_tokens_total"][1] == 3 and got["vllm:prompt_tokens_total"][1] == 7
    assert got["vllm:time_to_first_token_seconds_count"][1] == 1
    assert got["vllm:inter_token_latency_seconds_count"][1] == 1
    assert got["vtoken:requests_total"] == ({"door": "http", "status": "ok"}, 1.0)
    assert got["vtoken:placements_total"] == ({"strategy": "free_blocks", "replica": "r1"}, 5.0)
    assert got["vtoken:autoscaler_decisions_total"] == ({"direction": "out", "trigger": "manual"}, 1.0)
    other = [s.name for f in text_string_to_metric_families(b.render(None).decode()) for s in f.samples]
    assert other == ["vtoken:inflight_requests"]  # nothing of a's requests, no replica series without a snapshot


def test_capacity_feed_sends_at_once_then_coalesces_changes_and_stops_polling_without_watchers():
    import asyncio

    from cluster.capacity import CapacityFeed

    class Ctl:
        def __init__(self):
            self.free, self.polls = 10, 0
            ctl = self

            class Snapshot:
                def remote(self):
                    ctl.polls += 1
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_result(_snapshot(free_blocks=ctl.free, total_blocks=10))
                    return fut

            self.snapshot = Snapshot()

    async def go():
        ctl = Ctl()
        feed = CapacityFeed(ctl, poll_s=0.01)
        got, times = [], []

        async def watch():
            async for rows in feed.watch(0.3):
                got.append(rows[0].free_blocks)
                times.append(asyncio.get_running_loop().time())

        task = asyncio.ensure_future(watch())
        await asyncio.sleep(0.1)
        for free in (9, 8, 7):  # three changes within one interval: one update, the latest
            ctl.free = free
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        polls = ctl.polls
        await asyncio.sleep(0.1)
        return got, times, polls, ctl.polls, feed

    got, times, polls, later, feed = asyncio.run(go())
    assert got == [10, 7], got
    assert times[1] - times[0] >= 0.29
    assert later == polls and feed.watchers == 0  # no watcher, no polling


def test_the_grafana_dashboard_plots_only_series_the_server_exposes():
    import json
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from actors.engines import Chunk
    from cluster.metrics import Metrics

    m = Metrics("m")
    t = m.timer("http", 3)
    t.chunk("r1", Chunk("x", (1,)))
    t.chunk("r1", Chunk("y", (2,), True, "stop"))
    t.done("ok")
    text = m.render(_snapshot(total_blocks=10)).decode()
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dash = json.loads((ROOT / "configs" / "grafana-vtoken.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\b((?:vllm|vtoken):[a-z_]+)", e)}
    assert used and used <= exposed, used - exposed
    assert {"vtoken:blocks_reclaimed", "vllm:kv_cache_usage_perc"} <= {
        n for t in dash["panels"][0]["targets"] for n in re.findall(r"(?:vllm|vtoken):[a-z_]+", t["expr"])
    }  # the headline: reclaimed blocks against KV usage, per replica
