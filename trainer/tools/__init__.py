"""Tools in rollouts (issue 32): the model calls Python tools while it reasons (TRL's `tools`,
`environment_factory`, `max_tool_calling_iterations`).

    types.py          ToolCall, ToolResult (what the loop and the runtime pass)
    schemas.py        tools by name and their JSON schemas (transformers' get_json_schema); environments
    parsing.py        the calls in one assistant turn (Qwen2.5 <tool_call>, or transformers' response parsing)
    templates.py      the run's response and chat templates as TRL 1.16 sets them up (TRL's own helpers)
    calculator.py     the built-in `calculator` (bounded arithmetic over the syntax tree; runs in-process)
    python_tool.py    the built-in `python` (runs a snippet in the executor)
    executor.py       the reused tool process: timeout, rlimits, scratch folder (executor_worker.py: its child side)
    toolbox.py        ToolBox, the face the rollout loop calls
    loop.py           the multi-turn rollout loop
"""
from trainer.tools.toolbox import ToolBox
from trainer.tools.types import ToolCall, ToolResult

__all__ = ["ToolBox", "ToolCall", "ToolResult"]
