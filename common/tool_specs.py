"""The spelling of GRPOConfig's tool fields, checked at config load (no import: trainer/tools/ loads them).

`tools` entries: a built-in name (calculator, python), `module:function`, `pkg.module.function` or
`path/to/file.py:function` (common/user_code.py). `environment_factory`: a class named the same ways.
"""
from __future__ import annotations

from common.user_code import split_spec

BUILTIN_TOOLS = ("calculator", "python")


def tool_spec_errors(tools: list, environment_factory: str | None) -> list[str]:
    """One message per bad entry (empty: all well-formed). Duplicates are refused: a tool name is a key."""
    errors = []
    if not isinstance(tools, list):
        return [f"tools must be a list of names, got {tools!r}"]
    for spec in tools:
        if not isinstance(spec, str) or not spec.strip():
            errors.append(f"tools: {spec!r} is not a name")
        elif spec.strip() not in BUILTIN_TOOLS:
            try:
                split_spec(spec.strip())
            except ValueError:
                errors.append(f"tools: {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                              f"'module:function' / 'path/to/file.py:function'")
    names = [s.strip() for s in tools if isinstance(s, str)]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        errors.append(f"tools: {', '.join(dups)} given more than once")
    if environment_factory is not None:
        try:
            split_spec(str(environment_factory).strip())
        except ValueError:
            errors.append(f"environment_factory: {environment_factory!r} names no class: write 'module:Class' or "
                          f"'path/to/file.py:Class'")
    return errors
