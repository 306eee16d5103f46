"""Whether a run writes checkpoints at all: TRL's save_strategy (transformers TrainingArguments), a mixin of
GRPOConfig (common/config.py). "steps" (the default) saves every save_steps steps and at the end (trainer/loop.py);
"no" saves nothing, neither the DeepSpeed state nor an HF directory: a benchmark or smoke run that keeps no weights
(bench/gpu_check.py: one checkpoint in all its runs, a 0.5B one is ~7 GB).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.settings.choices import SaveStrategy
from common.settings.knobs import knob


@dataclass
class Saving:
    save_strategy: SaveStrategy = knob("steps", "TRL name: 'steps' saves a checkpoint every save_steps steps and at "
                                                "the end (DeepSpeed state for --resume and an HF directory); 'no' "
                                                "saves nothing (TRL's 'epoch'/'best' are not supported: a run is "
                                                "counted in steps).")
