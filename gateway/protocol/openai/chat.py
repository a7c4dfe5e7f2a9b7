"""Chat messages: OpenAI's `messages` array parsed to `ChatMessage`s, and the default chat template.

Roles are system, user, assistant and tool (`developer`, OpenAI's newer name for system, reads as
system). Content is a string or an array of text parts, joined by newlines; an assistant message may
have none. The default template, `<|role|>\\ncontent\\n` per message then `<|assistant|>\\n`, is
rendered here as plain Python (`render_default`); the gateway renders the same template through Jinja
(gateway/server/api/chat_template.py), and a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.protocol.openai.errors import InvalidRequest
from gateway.protocol.openai.fields import INVALID_TYPE, UNSUPPORTED, Fields, json_type

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        d = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        return d


def render_default(messages: Iterable[tuple[str, str]]) -> str:
    """The default chat template for (role, content) pairs, with the generation prompt."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


def parse_messages(f: Fields) -> tuple[ChatMessage, ...]:
    """`f`'s "messages". A bad content part is named by its bad field (`messages[i].content[j].type`)."""
    items = f.array("messages")
    if items is None:
        raise f.missing("messages")
    if not items:
        raise f.fail("messages", "must be a non-empty array of messages")
    out = []
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(
                f"'{where}' must be an object, got {json_type(m)}", param=where, code=INVALID_TYPE
            )
        mf = Fields(m, prefix=f"{where}.")
        role = mf.string("role")
        if role is None:
            raise mf.missing("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise mf.fail("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        out.append(ChatMessage(role, _content(mf, role), mf.string("name")))
    return tuple(out)


def _content(mf: Fields, role: str) -> str:
    """A string, or text parts joined by newlines; assistant messages may have none."""
    v = mf.raw("content")
    if v is None and role == "assistant":
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise mf.wrong("content", "a string or an array of content parts")
    texts = []
    for j, part in enumerate(v):
        where = f"{mf.name('content')}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(
                f"'{where}' must be an object, got {json_type(part)}", param=where, code=INVALID_TYPE
            )
        if part.get("type") != "text":
            why = f"{part.get('type')!r} is not supported (only 'text')"
            raise _bad_part(where, "type", why, UNSUPPORTED)
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad_part(where, "text", f"must be a string, got {json_type(text)}", INVALID_TYPE)
        texts.append(text)
    return "\n".join(texts)


def _bad_part(where: str, field: str, why: str, code: str) -> InvalidRequest:
    return InvalidRequest(f"'{where}.{field}' {why}", param=f"{where}.{field}", code=code)
