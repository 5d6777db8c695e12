"""A request's chat_template_kwargs hold only the variables the model's chat template reads
(cluster/serving/template_kwargs.py), with SmolLM2's real tokenizer and template as vLLM's renderer in the gateway
resolves them: every argument of transformers' renderer is refused by name on every route whose vLLM model carries the
field; a variable a template reads passes; the routes table is held against vLLM's app. No Ray, no server, no engine
client: the gateway's vLLM config, its renderer and vLLM's app (routes only, never called)."""

from __future__ import annotations

import importlib
import typing
from types import SimpleNamespace

import pytest

from cluster.config import parse_config
from cluster.serving.requests import BadRequest
from cluster.serving.template_kwargs import (
    CARRIERS,
    FIELD,
    LISTED,
    TemplateKwargs,
    check_template_kwargs,
    template_variables,
)

pytestmark = pytest.mark.smollm
CFG = parse_config({"model": "smollm2-135m", "engine": {"kind": "fake"}, "gateway": {"port": 0, "http_port": 0}})
MSG = [{"role": "user", "content": "hi"}]
# A realistic body of each route, without chat_template_kwargs
BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": MSG},
    "/v1/chat/completions/batch": {"model": "m", "messages": [MSG, MSG]},
    "/v1/chat/completions/render": {"model": "m", "messages": MSG},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/responses/render": {"model": "m", "input": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": MSG},
    "/v1/messages/render": {"model": "m", "max_tokens": 8, "messages": MSG},
    "/v1/messages/count_tokens": {"model": "m", "messages": MSG},
    "/tokenize": {"model": "m", "messages": MSG},
    "/v1/systemone": {"model": "m", "state": "a cat", "questions": {"q": {"type": "yes_no"}}},
    "/invocations": {"model": "m", "messages": MSG},
}
# transformers' renderer's own names (apply_chat_template's arguments, what render_jinja_template binds, its
# globals), a special token, and a name no template here reads
REFUSED = [
    "padding", "truncation", "max_length", "tokenizer_kwargs", "chat_template", "tokenize", "tools", "documents",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "messages", "conversation",
    "add_generation_prompt", "continue_final_message", "raise_exception", "strftime_now", "bos_token", "eos_token",
    "my_var",
]  # fmt: skip
STUB = "{{ my_var }}{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ padding }}{% endfor %}"


@pytest.fixture(scope="module")
def gateway():
    """What the gateway builds (cluster/serving/frontend.py): vLLM's config for SmolLM2, its renderer (as
    RemoteEngineClient.renderer), the loaded --chat-template (as OnlineRenderer.chat_template: none) and vLLM's
    app, whose routes are registered by build_app."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.renderers import renderer_from_config
    from vllm.renderers.chat_utils import load_chat_template

    from cluster.serving.frontend import frontend
    from cluster.serving.remote_engine import SUPPORTED_TASKS

    fe = frontend(CFG)
    renderer = renderer_from_config(fe.vllm_config)
    app = build_app(fe.args, SUPPORTED_TASKS, fe.vllm_config.model_config)
    yield SimpleNamespace(renderer=renderer, chat_template=load_chat_template(fe.args.chat_template), app=app)
    renderer.shutdown()


@pytest.fixture(scope="module")
def smollm(gateway) -> TemplateKwargs:
    return TemplateKwargs.of(gateway.renderer, gateway.chat_template)


def body(path: str, kwargs) -> dict:
    return {**BODIES[path], FIELD: kwargs}


def refusal(path: str, kwargs, variables: frozenset[str]) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        check_template_kwargs(body(path, kwargs), variables, path)
    assert "\n" not in str(e.value)
    return e.value


# ------------------------------------------------------------------------------------------ SmolLM2's template
def test_smollm2s_template_reads_only_what_the_renderer_binds(gateway, smollm):
    """SmolLM2's template (its chat_template.jinja, as vLLM resolves it) reads messages and add_generation_prompt,
    both the renderer's: a request may set no variable."""
    tok = gateway.renderer.get_tokenizer()
    assert gateway.chat_template is None and "SmolLM" in tok.chat_template
    assert template_variables(tok.chat_template) == {"messages", "add_generation_prompt"}
    assert smollm.variables == frozenset()


@pytest.mark.parametrize("key", REFUSED)
@pytest.mark.parametrize("path", sorted(CARRIERS))
def test_every_renderer_argument_is_refused_by_name_on_every_route(smollm, path, key):
    e = refusal(path, {key: True}, smollm.variables)
    assert e.param == f"chat_template_kwargs.{key}"
    assert str(e).startswith(f"chat_template_kwargs.{key}: '{key}' is not a variable of the model's chat template")
    assert "reads no variable a request may set" in str(e)
    with pytest.raises(BadRequest):  # through the door's one call too
        smollm.check(path, body(path, {key: True}))


@pytest.mark.parametrize("path", sorted(CARRIERS))
def test_no_kwargs_null_and_empty_pass_and_a_non_object_is_refused(smollm, path):
    for ok in (None, {}):
        smollm.check(path, body(path, ok))
    smollm.check(path, BODIES[path])
    for bad, kind in (([], "an array"), ("padding", "a string"), (3, "a number"), (True, "a boolean")):
        e = refusal(path, bad, smollm.variables)
        assert e.param == "chat_template_kwargs" and str(e).endswith(f"got {kind}")


# ------------------------------------------------------------------------------------------ a template's variables
def test_a_variable_the_template_reads_passes_and_the_renderers_names_stay_refused(gateway):
    """The server's --chat-template (vLLM's first choice) reading my_var, bos_token and padding: my_var passes on
    every route; bos_token (the tokenizer's special token, which transformers binds) and padding (apply_chat_template
    takes it as its own argument: the template never receives it) are still refused."""
    stub = TemplateKwargs.of(gateway.renderer, STUB)
    assert template_variables(STUB) == {"my_var", "messages", "bos_token", "padding"}
    assert stub.variables == {"my_var"}
    for path in CARRIERS:
        stub.check(path, body(path, {"my_var": "x"}))
        for key in ("bos_token", "padding", "messages"):
            assert refusal(path, {"my_var": 1, key: 1}, stub.variables).param == f"chat_template_kwargs.{key}"
    assert "the template reads my_var" in str(refusal("/v1/chat/completions", {"other": 1}, stub.variables))


def test_negative_control_the_check_refuses_by_the_variables_not_by_a_list_of_names():
    """With variables that hold padding and tools, both pass: the refusals above come from the template's
    variables, and the same check lets through what a template reads."""
    for path in CARRIERS:
        check_template_kwargs(body(path, {"padding": True, "tools": []}), frozenset({"padding", "tools"}), path)
        assert refusal(path, {"padding": True}, frozenset({"tools"})).param == "chat_template_kwargs.padding"


def test_a_refusal_names_the_variables_sorted_and_at_most_twenty():
    variables = frozenset(f"v{i:02d}" for i in range(LISTED + 5))
    message = str(refusal("/v1/chat/completions", {"padding": 1}, variables))
    assert message.endswith(f"the template reads {', '.join(f'v{i:02d}' for i in range(LISTED))} and 5 more")
    assert "(an argument of the chat template's renderer)" in message


def test_template_variables_parse_as_vllm_parses():
    """vLLM's {% generation %} tag and loop controls parse; named templates read the union of theirs; a template
    that does not parse reads nothing."""
    text = "{% for m in messages %}{% if m.x %}{% break %}{% endif %}{% generation %}{{ a }}{% endgeneration %}"
    text += "{% endfor %}"
    assert template_variables(text) == {"messages", "a"}
    assert template_variables({"default": "{{ a }}", "tool_use": "{{ b }}{{ tools }}"}) == {"a", "b", "tools"}
    assert template_variables("{% for %}") == frozenset() and template_variables(None) == frozenset()


# ------------------------------------------------------------------------------------------ where vLLM reads it
def test_routes_whose_model_has_no_field_or_only_in_another_form_are_not_checked(smollm):
    bad = {"padding": True}
    for path, shape in (
        ("/tokenize", {"model": "m", "prompt": "hi"}),  # TokenizeCompletionRequest: no such field
        ("/invocations", {"model": "m", "prompt": "hi"}),  # a CompletionRequest
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
        ("/inference/v1/generate", {"token_ids": [1], "reasoning_parser_kwargs": {FIELD: bad}}),
    ):
        smollm.check(path, {**shape, FIELD: bad})
    smollm.check("/v1/chat/completions", [{FIELD: bad}])  # not an object: vLLM's own validation answers


@pytest.mark.parametrize("path", sorted(CARRIERS))
def test_the_field_checked_is_the_one_vllms_model_reads(path):
    """Each route's example body, parsed by the vLLM model the table names, carries the kwargs where the check
    looked for them."""
    carrier = CARRIERS[path]
    model = getattr(importlib.import_module(carrier.module), carrier.model)
    assert model.model_validate(body(path, {"my_var": 1})).chat_template_kwargs == {"my_var": 1}


def _models(annotation) -> list[type]:
    args = typing.get_args(annotation)
    found = [m for a in args for m in _models(a)] if args else [annotation]
    return [m for m in found if isinstance(m, type)]


def _carrying(routes) -> dict[str, set[str]]:
    """POST path -> the request models with a top-level chat_template_kwargs field that its body is parsed into."""
    out: dict[str, set[str]] = {}
    for r in routes:
        field = getattr(r, "body_field", None)
        if "POST" not in (getattr(r, "methods", None) or ()) or field is None:
            continue
        found = {m.__name__ for m in _models(field.field_info.annotation) if FIELD in getattr(m, "model_fields", {})}
        if found:
            out[r.path] = found
    return out


def test_the_table_is_every_route_of_vllms_app_whose_model_has_the_field(gateway):
    """Every POST route of the gateway's vLLM app (its scale-out render routes as --enable-scale-out registers
    them; SageMaker's /invocations by the models it tries) whose request model has chat_template_kwargs is in
    CARRIERS with that model, and nothing else is."""
    from vllm.entrypoints.generate.factories import get_generate_invocation_types
    from vllm.entrypoints.scale_out.render.api_router import router as render_router

    from cluster.serving.remote_engine import SUPPORTED_TASKS

    paths = {getattr(r, "path", None) for r in gateway.app.routes}
    found = _carrying(gateway.app.routes) | _carrying(render_router.routes)
    invocations = {m.__name__ for m, _ in get_generate_invocation_types(SUPPORTED_TASKS) if FIELD in m.model_fields}
    found["/invocations"] = invocations
    assert set(found) <= paths
    assert found == {path: {c.model} for path, c in CARRIERS.items()}
