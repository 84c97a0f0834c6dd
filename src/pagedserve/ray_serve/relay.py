"""What the front door hands an engine replica: one HTTP request, read whole, and the text its
routing is keyed on. Plain data (no Ray): it crosses processes by pickle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Requests whose prompt decides which replica holds useful prefix pages.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Routing needs only the leading text: a prefix this long already picks one replica.
ROUTING_KEY_CHARS = 8192


@dataclass
class RelayedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    routing_key: str  # the prompt's leading text ("" where there is none)

    def asgi_scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": self.headers,
            "client": self.client,
            "server": None,
        }


def _text_of(content: Any) -> str:
    """A chat message's content: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def routing_key(path: str, body: bytes) -> str:
    """The prompt's leading text: a completion's (first) prompt, or a chat's messages in order,
    each behind its role. Token-id prompts are keyed by their ids written out. A body that does
    not parse gives "" (the replica answers its 400)."""
    if path not in GENERATION_PATHS:
        return ""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return ""
        key = "".join(
            f"<{m.get('role')}>{_text_of(m.get('content'))}"
            for m in messages
            if isinstance(m, dict)
        )
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the first prompt stands for the rest
        if isinstance(prompt, list):
            prompt = " ".join(str(t) for t in prompt)
        key = prompt if isinstance(prompt, str) else ""
    return key[:ROUTING_KEY_CHARS]
