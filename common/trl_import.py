"""TRL 1.16 (a pinned dependency, pure Python) imported where its helpers are called, and only what we call of it.

    ctu = trl_module("chat_template_utils")      # trl.chat_template_utils, imported once per process

What `import trl` does to a process besides the import, and what we do about it:
- it sets VLLM_LOGGING_LEVEL=ERROR when vLLM is installed and the variable is unset (trl/_compat.py): a worker
  that starts vLLM after it would log nothing but errors. The variable is put back as it was (unset, or the
  user's value) after the import.
- its generation modules warn on a vLLM outside 0.22-0.31 (trl/import_utils.py is_vllm_available). We pin vLLM
  0.32 (CPU), 0.33 (CUDA 13) and 0.19.1 (CUDA 12) and run our own engines, never TRL's vLLM code, so that warning
  is not about this trainer: it is filtered during the import (the modules we import do not emit it today).
- trl.chat_template_utils reads TRL's ~70 chat templates from its package at import: `import trl` and it cost
  about 0.6 s in a process that already has torch and transformers (docs/benchmarks.md), so nothing imports it
  at module level: only a tool run (and `launch.sh check` of one) pays it.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings

_VLLM_RANGE_WARNING = r"TRL currently supports vLLM versions"  # trl/import_utils.py is_vllm_available


def trl_module(name: str):
    """trl.<name>, imported once; the process environment as it was before the import."""
    full = f"trl.{name}"
    if full in sys.modules:
        return sys.modules[full]
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_VLLM_RANGE_WARNING)
            return importlib.import_module(full)
    finally:
        if before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = before
