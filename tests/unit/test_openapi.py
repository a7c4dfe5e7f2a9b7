"""/openapi.json is derived, not kept: its paths are the app's routes (not /admin), its bodies say
exactly the fields the parsers read, with this server's bounds, and it is valid OpenAPI 3.1 as
schemathesis reads it. The SGLang-native sampling keys are one table for the parser and the schema."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import schemathesis
from aiohttp import web

from gateway.config import Config, GatewaySection, LimitsSection
from gateway.protocol.openai import schema
from gateway.protocol.openai.fields import Fields
from gateway.protocol.openai.requests import Bounds, parse_chat, parse_completion, parse_generate
from gateway.protocol.openai.sampling import HONOURED_BY_GATEWAY, HONOURED_BY_WORKER, NEUTRAL, is_neutral
from gateway.server.api.openapi import document
from gateway.server.api.routes import CLIENT_API, add_client_routes
from gateway.server.api.tokenizer import ByteTokenizer

BOUNDS = Bounds(model="m", vocab_size=259, default_max_tokens=16, max_new_tokens=100, max_n=4)


class Reads(dict[str, Any]):
    """A JSON object that records which fields a parser reads."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def fields_of(struct: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


def test_the_bodies_declare_exactly_the_fields_the_parsers_read() -> None:
    body, opts = Reads(prompt="x"), Reads()
    body["stream_options"] = opts
    parse_completion(body, BOUNDS)
    assert body.read == fields_of(schema.completion_request(BOUNDS))
    assert opts.read == fields_of(schema.StreamOptions)

    message, part = Reads(role="user"), Reads(type="text", text="hi")
    message["content"] = [part]
    chat = Reads(messages=[message])
    parse_chat(chat, BOUNDS)
    assert chat.read == fields_of(schema.chat_request(BOUNDS))
    for role in schema.MESSAGE_ROLES:  # the role is each message type's tag
        assert message.read == {"role"} | fields_of(schema.chat_message(role))
    assert {"type", "text"} == fields_of(schema.TextPart)

    sp = Reads()
    gen = Reads(input_ids=[1, 2], return_logprob=True, sampling_params=sp)
    parse_generate(gen, BOUNDS)
    text, ids = schema.generate_requests(BOUNDS)
    assert gen.read == fields_of(text) | fields_of(ids) and fields_of(text) ^ fields_of(ids) == {
        "text",
        "input_ids",
    }
    assert sp.read == HONOURED_BY_GATEWAY
    assert fields_of(schema.sampling_params(BOUNDS)) == HONOURED_BY_GATEWAY | NEUTRAL.keys()


def test_the_bodies_carry_the_servers_bounds() -> None:
    types = [t for alternatives in schema.request_bodies(BOUNDS).values() for t in alternatives]
    components = msgspec.json.schema_components(types, ref_template="#/c/{name}")[1]
    props = components["CompletionRequest"]["properties"]
    assert props["model"]["anyOf"][0] == {"enum": ["m"]}
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 100
    assert props["n"]["anyOf"][0]["maximum"] == 4
    assert props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 258
    assert components["GenerateSamplingParams"]["additionalProperties"] is False
    assert components["CompletionRequest"]["required"] == ["prompt"]
    assert components["UserMessage"]["required"] == ["role", "content"]
    assert "content" not in components["AssistantMessage"].get("required", [])
    assert components["GenerateTextRequest"]["required"] == ["text"]


def test_neutral_values_compare_by_value() -> None:
    assert is_neutral(None, ()) and is_neutral(1, (1.0,)) and is_neutral(0.0, (0,))
    assert not is_neutral(True, (1,)) and not is_neutral(1.5, (1.0,)) and not is_neutral("x", ("",))
    assert is_neutral([], ("", [])) and not is_neutral(["a"], ("", []))
    assert HONOURED_BY_WORKER < HONOURED_BY_GATEWAY


async def _health(request: web.Request) -> web.Response:
    """Liveness of the gateway"""
    return web.json_response({})


def app_document(keys: tuple[str, ...] = ()) -> dict[str, Any]:
    app = web.Application()
    config = Config(gateway=GatewaySection(api_keys=keys), limits=LimitsSection(max_n=4))
    add_client_routes(app, config=config, tokenizer=ByteTokenizer(), generator=None)  # type: ignore[arg-type]
    app.router.add_get("/health", _health)
    app.router.add_get("/admin/workers", _health)
    api = app[CLIENT_API]
    return document(app.router.routes(), api.routes, api.bounds, title="t", version="0", keys=bool(keys))


@pytest.mark.parametrize("keys", [(), ("secret-key-0001",)])
def test_the_document_lists_every_route_but_admin_and_is_valid_openapi(keys: tuple[str, ...]) -> None:
    doc = app_document(keys)
    assert doc["openapi"] == "3.1.0"
    ops = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert ops == {
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/v1/models/{model}", "get"),
        ("/generate", "post"),
        ("/openapi.json", "get"),
        ("/health", "get"),
    }
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/GenerateTextRequest"},
            {"$ref": "#/components/schemas/GenerateIdsRequest"},
        ]
    }
    errors = {int(s) for s in completions["responses"] if s != "200"}
    assert {400, 404, 413, 429, 503} <= errors and (401 in errors) == bool(keys)
    assert "Retry-After" in completions["responses"]["429"]["headers"]
    assert doc["paths"]["/health"]["get"]["summary"] == "Liveness of the gateway"
    assert doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
    assert ("security" in completions) == bool(keys)
    loaded = schemathesis.openapi.from_dict(doc)
    loaded.validate()  # against the OpenAPI 3.1 meta-schema
    assert all(op.ok() for op in loaded.get_all_operations())


def test_the_error_schema_is_the_error_body() -> None:
    from gateway.protocol.openai.errors import InvalidRequest

    body = msgspec.json.encode(InvalidRequest("bad", param="x", code="c").body())
    assert msgspec.json.decode(body, type=schema.ErrorResponse).error.param == "x"
    assert Fields({}).items() == []
