"""Serving config: the shipped files load, a bad value is one line naming the field, the HTTP port rules, the
`ray up` files pass Ray's own schema and the generated gRPC modules are current. No Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config

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


def test_health_requires_auth_is_a_documented_gateway_field():
    from cluster.config import GatewayConfig

    assert GatewayConfig().health_requires_auth is False
    assert "probes" in GatewayConfig.model_fields["health_requires_auth"].description


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
