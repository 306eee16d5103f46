"""Start-up order on a shared GPU (issue 42): who waits for whom before touching the GPU. launch.sh's placement
(common/placement/plan.py) sets these; docs/gpus.md says why (vLLM profiles its GPU's free memory at start and
fails when another process on that GPU allocates or frees memory meanwhile).

No torch here: config classes import this for --help and validation.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.knobs import knob


@dataclass
class StartOrder:
    start_after: list = knob([], "genonly: build the generation engine only once these workers (ids like worker0) "
                                 "have theirs up (a heartbeat past their start at the ref server). launch.sh sets "
                                 "it for a vLLM worker sharing a GPU with an earlier one: they start one after "
                                 "the other. At most wait_for_ranks_timeout seconds, then the worker exits "
                                 "naming them.")
    gen_wait_for_workers: list = knob([], "Trainer ranks: do not generate rollouts themselves while these workers "
                                          "(ids like worker0) are still starting. launch.sh sets it when a vLLM "
                                          "worker shares a GPU with the ranks. After wait_for_ranks_timeout seconds "
                                          "the ranks generate anyway, saying which worker never came.")
