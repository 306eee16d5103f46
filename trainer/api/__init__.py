"""The Python API: a TRL 1.16 GRPO script runs with one import changed (docs/trl.md, examples/trl_script.py).

    from trainer.api import GRPOConfig, GRPOTrainer      # instead of: from trl import GRPOConfig, GRPOTrainer

GRPOConfig takes TRL's names (and ours) through the JSON config's loader (trainer/api/config.py); GRPOTrainer maps
TRL's arguments onto this system's config (trainer/api/inputs.py, names.py) and train() runs `launch.sh train`
(trainer/api/process.py, trainer/api/trainer.py). No torch is imported here.
"""
from trainer.api.config import GRPOConfig
from trainer.api.process import TrainingFailed
from trainer.api.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainingFailed"]
