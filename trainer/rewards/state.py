"""TrainerState: what TRL's `trainer_state` keyword gives a reward function, in the fields its recipes read.

TRL passes the Trainer's own `TrainerState`; curriculum rewards read `trainer_state.global_step` (and
`max_steps`, `epoch`). Here `global_step` is the policy version that sampled the batch (a genonly worker's
batches may be a version or two behind the trainer), `max_steps` is `all_steps`, `epoch` the passes over the
training data so far (fractional, as TRL's), 0 when unknown (eval).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
