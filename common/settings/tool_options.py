"""GRPOConfig's fields for tools in rollouts (issue 32; trainer/tools/, docs/tools.md): a mixin of their own,
as common/settings/model_options.py's ModelLoading, so that common/config.py stays small. Their spelling is
checked at config load (common/settings/tool_specs.py); the "tools" section of --help lists them
(common/settings/sections.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.knobs import knob


@dataclass
class ToolOptions:
    tools: list = knob([], "Tools the model may call while it generates (TRL's tools): built-in calculator "
                           "(bounded arithmetic, in-process) and python (runs a snippet), or your typed functions "
                           "with Google-style docstrings as 'module:function' or 'path/to/file.py:function'. Their "
                           "JSON schemas (transformers' get_json_schema) reach the chat template.")
    environment_factory: str | dict | None = knob(None, "TRL's environment_factory: a class ('module:Class' or "
                                                        "'path/to/file.py:Class') whose public methods besides "
                                                        "reset are tools, or {name: class} routed by an "
                                                        "`environment` column (docs/tools.md).")
    max_tool_calling_iterations: int | None = knob(None, "TRL's name: tool rounds per completion at most (null = "
                                                         "no limit: a turn without a call, or max_new_tokens, ends "
                                                         "it; 0 = tools are shown but never run).")
    tool_timeout: float = knob(10.0, "Seconds one tool call may take; past it the tool process is killed (and "
                                     "restarted) and the model reads that the call timed out. Also the call's "
                                     "CPU-time limit (RLIMIT_CPU).")
    tool_output_chars: int = knob(1000, "A tool's result is cut to this many characters before the model reads it.")
