"""Tools by name, and their JSON schemas as transformers derives them (`transformers.utils.get_json_schema`).

A tool is a typed Python function with a Google-style docstring (TRL's contract): a description line, then an
`Args:` entry for every argument. A function without them fails here, in one line naming it and what is missing.

`environment_factory` names a class (TRL): its public methods other than `reset` (and `get_reward`, which TRL
keeps for the reward) are the tools. Their schemas come from the class's functions, so no instance is built in
the rollout process: instances live in the executor process, one per rollout (trainer/tools/executor.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from common.settings.tool_specs import BUILTIN_TOOLS, environment_specs
from common.user_code import load_object
from trainer.tools.calculator import calculator
from trainer.tools.types import one_line

PYTHON_TOOL_SPEC = "trainer.tools.python_tool:python"  # how the executor loads the built-in `python`
ENV_NOT_TOOLS = ("reset", "get_reward")  # TRL: reset starts an episode, get_reward scores it


@dataclass
class ToolDef:
    """One tool the model may call. where: "inline" (called in this process: the calculator), "executor" (a
    function the executor loads by `spec`) or "env" (a method of the episode's environment instance)."""
    name: str
    schema: dict
    where: str
    spec: str = ""
    fn: Any = None
    env: str = ""  # "env" tools: the environment's name in a dict environment_factory ("" for a single class)


def schema_of(fn: Any, label: str) -> dict:
    """fn's JSON schema; ValueError in one line naming `label` and what is missing."""
    from transformers.utils import get_json_schema  # (transformers is imported lazily, like everywhere else)
    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException / DocstringParsingException, said in one line
        raise ValueError(f"tool {label}: {one_line(e)} (a tool needs a type hint on every argument and a "
                         f"Google-style docstring: a description, then 'Args:' with one line per argument)") from e


def _load_function(spec: str) -> ToolDef:
    fn = load_object(spec)
    if inspect.isclass(fn):
        raise ValueError(f"tool {spec!r} is a class: give a function (a class of tools goes in environment_factory)")
    schema = schema_of(fn, repr(spec))
    return ToolDef(schema["function"]["name"], schema, "executor", spec=spec)


def load_environment(spec: str, env: str = "") -> list[ToolDef]:
    """The tools of the environment class `spec` names: its public methods but reset/get_reward."""
    cls = load_object(spec)
    if not inspect.isclass(cls):
        raise ValueError(f"environment_factory {spec!r} is not a class (one instance per rollout is built from it)")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"environment_factory {spec!r}: {cls.__name__} has no reset() method (it starts an episode)")
    defs = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in ENV_NOT_TOOLS:
            continue
        if inspect.isfunction(member) or inspect.ismethod(member):  # methods, and classmethods (bound to cls)
            schema = schema_of(member, f"{cls.__name__}.{name} (environment_factory {spec!r})")
            defs.append(ToolDef(name, schema, "env", spec=spec, env=env))
    return defs  # none: a reset-only class (TRL accepts it: reset() writes the prompt, get_reward() may score it)


def load_tools(tools: list[str], environment_factory: str | dict | None) -> list[ToolDef]:
    """Every tool of the config, in order (tools, then each environment's methods); names must be unique among the
    tools one rollout sees (the functions and its environment's methods: two environments may share a name)."""
    defs = []
    for raw in tools:
        spec = raw.strip()
        if spec == "calculator":
            defs.append(ToolDef("calculator", schema_of(calculator, "'calculator'"), "inline", fn=calculator))
        elif spec == "python":
            from trainer.tools.python_tool import python
            defs.append(ToolDef("python", schema_of(python, "'python'"), "executor", spec=PYTHON_TOOL_SPEC))
        else:
            assert spec not in BUILTIN_TOOLS, spec
            defs.append(_load_function(spec))
    functions = list(defs)
    for env, spec in environment_specs(environment_factory).items():
        defs += load_environment(spec, env)
    for env in environment_specs(environment_factory) or {"": None}:
        seen: dict[str, str] = {}
        for d in functions + [d for d in defs if d.where == "env" and d.env == env]:
            if d.name in seen:
                raise ValueError(f"two tools are called {d.name!r} ({seen[d.name]} and {d.spec or d.name}): the "
                                 f"model calls tools by name, so names must be unique")
            seen[d.name] = d.spec or d.name
    return defs
