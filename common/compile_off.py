"""torch.compile decorations made in a scope become no-ops: for libraries that compile, at import, kernels a run
never calls or would not gain from.

torch.compile(fn) returns fn itself when TORCHDYNAMO_DISABLE=1 (torch/_dynamo/eval_frame.py reads it when it
decorates, nowhere else), so the scope imports neither dynamo's compile machinery nor inductor for it (~1 CPU-s
each time that is the first compile in the process) and a call later never traces or builds a kernel. The
variable is set only inside the scope and restored after (the user's own value, or none), so every torch.compile
outside it is as before. Used at a process's start, where no other thread compiles:
- trainer/deepspeed_policy.py: around deepspeed.initialize, whose ZeRO code imports DeepSpeed's Muon optimizer
  module, which compiles Muon's kernels (unless ds_config's optimizer is Muon);
- trainer/engines/vllm.py: around an eager vLLM engine's import and construction on CPU, whose sampler compiles a
  one-line rank count (a dynamo trace and a C++ build on the first call).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

VAR = "TORCHDYNAMO_DISABLE"


@contextmanager
def compile_off() -> Iterator[None]:
    before = os.environ.get(VAR)
    os.environ[VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VAR, None)
        else:
            os.environ[VAR] = before
