"""`launch.sh check`'s tools lines (trainer/check.py runs them for a config with tools or environment_factory):
one line per tool (its import and JSON schema), then one for the set: unique names, the chat template shows every
tool to the model, which family's response template parses the calls and which chat template the run renders
with (TRL's training template where GRPOTrainer swaps one in: trainer/tools/templates.py), or refused in one line
where TRL refuses the model's template for a run with tools (Llama 3.1/3.2, a template that cannot write a call).
"""
from __future__ import annotations


def check_tools(c) -> None:
    """c: trainer.check.Checker, its config and tokenizer loaded."""
    specs = [str(t).strip() for t in c.cfg.tools or [] if str(t).strip()]
    failed_before = len(c.failed)
    for spec in specs:
        c.run("tools", lambda spec=spec: _schema_line(_load([spec], None)))
    env = c.cfg.environment_factory
    if env:
        c.run("tools", lambda: f"environment_factory {env}: " + _schema_line(_load([], env)))
    if len(c.failed) == failed_before:  # (a tool that failed above would fail this line again)
        c.run("tools", lambda: _check_tool_set(c, specs, env))


def _load(specs: list[str], env: str | None) -> list:
    from trainer.tools.schemas import load_tools
    return load_tools(specs, env)


def _schema_line(defs: list) -> str:
    if not defs:  # TRL accepts a reset-only environment class
        return "no tools (reset-only)"
    return "; ".join(f"{d.name}({', '.join(d.schema['function']['parameters'].get('properties', {}))})"
                     for d in defs) + " has a schema"


def _check_tool_set(c, specs: list[str], env: str | None) -> str:
    defs = _load(specs, env)
    names = [d.name for d in defs]
    if not names:
        return "no tools to show (a reset-only environment)"
    if c.tokenizer is None:
        return f"{len(names)} tools (chat template not checked: no tokenizer)"
    from trainer.tools.templates import tool_template
    # TRL's set-up for a run with tools: else refused, one line naming the model
    spec = tool_template(c.tokenizer, c.cfg.model, c.cfg.chat_template_kwargs)
    rendered = c.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[d.schema for d in defs],
                                               add_generation_prompt=True, tokenize=False, **spec.render_kwargs)
    missing = [n for n in names if n not in rendered]
    if missing:
        raise ValueError(f"the chat template does not show the tools {missing} to the model: give the model a "
                         f"template that renders `tools` (docs/tools.md)")
    return f"{len(names)} tools, all shown by the chat template; {spec.describe()}"
