"""The spelling of GRPOConfig's tool fields, checked at config load (no import: trainer/tools/ loads them).

`tools` entries: a built-in name (calculator, python), `module:function`, `pkg.module.function` or
`path/to/file.py:function` (common/user_code.py). `environment_factory`: a class named the same ways, or (TRL's
multi-environment form) an object {environment name: class}, each row picking one by its `environment` column.
"""
from __future__ import annotations

import json

from common.user_code import split_spec

BUILTIN_TOOLS = ("calculator", "python")


def environment_specs(value) -> dict[str, str]:
    """environment_factory as {environment name: class spec}: one class -> {"": spec} (every row); an object (or its
    JSON text, as the command line gives it) -> as given, routed by each row's `environment` column. ValueError,
    one line, for anything else."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"environment_factory {value!r} is not a JSON object ({e.msg})") from None
    if isinstance(value, dict):
        if not value or not all(isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
                                for k, v in value.items()):
            raise ValueError(f"environment_factory must map environment names to classes ('module:Class'), got "
                             f"{value!r}")
        return {k.strip(): v.strip() for k, v in value.items()}
    return {"": str(value).strip()}


def tool_spec_errors(tools: list, environment_factory: str | dict | None) -> list[str]:
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
    try:
        specs = environment_specs(environment_factory)
    except ValueError as e:
        return errors + [str(e)]
    for spec in specs.values():
        try:
            split_spec(spec)
        except ValueError:
            errors.append(f"environment_factory: {spec!r} names no class: write 'module:Class' or "
                          f"'path/to/file.py:Class'")
    return errors
