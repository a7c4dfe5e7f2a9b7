"""Chat messages to prompt text, through a Jinja chat template in a sandbox (like HF chat templates).

The template sees `messages` (a list of {"role", "content"[, "name"]} with content already a string),
`add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception(msg)`. A template that calls
`raise_exception` rejects the request (400); any other template failure is the configuration's fault
(500). A template that does not compile stops the gateway at start-up with a ConfigError.
The messages (`ChatMessage`) and the default template's plain-Python rendering, which workers use, are
gateway.protocol.openai.chat's; DEFAULT_TEMPLATE here is the same template in Jinja.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.config import ConfigError
from gateway.protocol.openai.chat import ChatMessage
from gateway.server.api.errors import GatewayError, InvalidRequest
from gateway.server.api.tokenizer import Tokenizer

# role-tagged and deterministic: "<|system|>\n...\n<|user|>\n...\n<|assistant|>\n" (chat.render_default)
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateRejected(jinja2.TemplateError):
    """Raised by the template's `raise_exception` helper."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRejected(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None, origin: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError("tokenizer.chat_template", origin, f"template does not compile: {exc}") from exc
        self._bos = bos_token or ""
        self._eos = eos_token or ""
        self.origin = origin

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer) -> ChatTemplate:
        """`path`: a Jinja file, a tokenizer_config.json (its "chat_template"), or "" for the default."""
        if not path:
            return cls(
                DEFAULT_TEMPLATE,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
                origin="default",
            )
        try:
            source = Path(path).read_text()
        except OSError as exc:
            raise ConfigError("tokenizer.chat_template", path, f"cannot read: {exc.strerror}") from exc
        if path.endswith(".json"):
            source = _template_from_config(path, source)
        return cls(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, origin=path)

    def render(self, messages: tuple[ChatMessage, ...], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateRejected as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except jinja2.TemplateError as exc:
            raise GatewayError(f"the chat template failed to render: {exc}") from exc


def _template_from_config(path: str, text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError("tokenizer.chat_template", path, f"not valid JSON: {exc}") from exc
    tpl = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(tpl, list):  # the named-templates form: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if not isinstance(tpl, str):
        raise ConfigError("tokenizer.chat_template", path, "has no string 'chat_template' entry")
    return tpl
