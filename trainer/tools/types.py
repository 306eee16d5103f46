"""What flows between the rollout loop and the tool runtime: a parsed call and its result (trainer/tools/)."""
from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "error", "timeout", "unknown_tool", "malformed")


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its keyword arguments."""
    name: str
    arguments: dict
    id: str | None = None  # if the template/parser gives one

    def to_dict(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (TRL's and the chat templates' shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments},
                **({"id": self.id} if self.id is not None else {})}


@dataclass
class ToolResult:
    """What the model reads back in the tool message, and how the call went.

    status: "ok" | "error" (the tool raised) | "timeout" (killed past tool_timeout) | "unknown_tool" |
    "malformed" (the call could not be parsed; name is then "")."""
    name: str
    content: str
    status: str
    seconds: float = 0.0

    def to_message(self) -> dict:
        """The tool message the model reads (TRL's shape: role, name, content)."""
        return {"role": "tool", "name": self.name, "content": self.content}


def one_line(text: str, limit: int = 300) -> str:
    """An error said in one line (whitespace runs folded), at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def truncate(text: str, limit: int) -> str:
    """At most `limit` characters; a cut says how much was cut, so the model knows the output goes on."""
    if len(text) <= limit:
        return text
    note = f"\n...[truncated {len(text) - limit} characters]"
    return text[:max(0, limit - len(note))] + note if limit > len(note) else text[:limit]
