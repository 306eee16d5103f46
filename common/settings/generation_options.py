"""How much a generation engine does per call and how it uses its device: the knobs whose best value depends on the
device (a GPU or a 2-core CPU), so most default to `auto`, resolved once at start by common/settings/gen_defaults.py
(launch.sh's placement, each worker and each rank call it; the resolved values are printed).

No torch here: config classes import this for --help and validation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.settings.knobs import knob

AUTO = "auto"


@dataclass
class GenerationOptions:
    Q_batch_size: int | Literal["auto"] = knob(AUTO, "Questions per generation round = per engine call (one "
                                                     "uploaded batch per question). auto: a whole training step's "
                                                     "prompts (train_batch_groups x grad_accum x the ranks a "
                                                     "producer feeds); on CUDA at least enough for 256 sequences; "
                                                     "never more than max_staleness steps use (docs/engines.md).")
    gen_batch_size: int | Literal["auto"] = knob(AUTO, "Max sequences in one HF generate call. auto: on CUDA a "
                                                       "whole round (Q_batch_size x num_pre_Q), cut to what the "
                                                       "GPU's free memory holds; on CPU 64.")
    vllm_eager: bool | Literal["auto"] = knob(AUTO, "vLLM enforce_eager: no CUDA graphs / compilation. auto: false "
                                                    "on CUDA (graphs: decoding is launch-bound), true on CPU (the "
                                                    "compiled mode was not faster there in our measurements).")
    vllm_enable_prefix_caching: bool = knob(True, "vLLM automatic prefix caching: a group's num_pre_Q samples and "
                                                  "every tool turn reuse their prompt's KV cache instead of "
                                                  "prefilling it again; reset whenever new weights load "
                                                  "(bench/generation_batching.py).")
    vllm_gpu_memory_utilization: float | Literal["auto"] = knob(AUTO, "vLLM share of GPU memory for weights + KV "
                                                                      "cache (CUDA only). auto: 0.9 on a GPU of its "
                                                                      "own, its share where launch.sh's placement "
                                                                      "puts it on a shared GPU (docs/gpus.md).")
