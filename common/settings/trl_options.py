"""TRL 1.16 GRPOConfig / TrainingArguments knobs honoured under their TRL names (issue 40), mixed into GRPOConfig.

    use_bias_correction_kl   the KL term weighted by the importance ratio (trainer/objective/grpo.py)
    warmup_ratio             warmup_steps = ceil(ratio x the final step count), resolved once that count is known
    num_train_epochs         all_steps from the training set's size (trainer/loop.py, resolve_epochs)
    chat_template_kwargs     extra arguments of the chat template (Qwen3's enable_thinking)

No torch here: config classes import this for --help and validation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.settings.knobs import knob


@dataclass
class TRLOptions:
    use_bias_correction_kl: bool = knob(False, "TRL name: multiply the per-token KL term by the importance ratio "
                                               "exp(logp - old_logp) (token or GSPO's sequence ratio, with its "
                                               "gradient), the unbiased reverse-KL gradient of DeepSeek-V3.2. TRL "
                                               "1.16's default is true; ours false keeps simple_GRPO's k3 gradient "
                                               "(docs/trl.md). Acts only with beta > 0.")
    warmup_ratio: float | None = knob(None, "TRL name: warmup_steps = ceil(warmup_ratio x all_steps), against the "
                                            "final step count (all_steps / max_steps from any source, or the one "
                                            "num_train_epochs gives). A later source's warmup_steps overrides it. "
                                            "null = warmup_steps as given.")
    num_train_epochs: float | None = knob(None, "TRL name: train for this many passes over the training prompts: "
                                                "all_steps = ceil(epochs x prompts / (ranks x grad_accum x "
                                                "train_batch_groups)) x mu, set when the ranks have loaded the data "
                                                "(groups skipped for zero spread still count as seen). An explicit "
                                                "all_steps / max_steps wins (as TRL's max_steps). null = all_steps.")
    chat_template_kwargs: dict = knob({}, "TRL name: extra keyword arguments of the chat template wherever a prompt "
                                          "is templated (rollouts, eval, check), e.g. {\"enable_thinking\": false} "
                                          "for Qwen3.")

    def trl_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1,
             f"warmup_ratio must be in [0, 1] (or null), got {self.warmup_ratio!r}"),
            (self.num_train_epochs is None or self.num_train_epochs > 0,
             f"num_train_epochs must be > 0 (or null = all_steps), got {self.num_train_epochs!r}"),
            (isinstance(self.chat_template_kwargs, dict), "chat_template_kwargs must be a JSON object"),
        ]

    def resolve_warmup(self) -> None:
        """warmup_steps from warmup_ratio against the step count as it stands (a step is one optimizer update)."""
        if self.warmup_ratio is not None and 0 <= self.warmup_ratio <= 1:
            self.warmup_steps = math.ceil(self.warmup_ratio * self.all_steps)

    def resolve_epochs(self, prompts: int, world: int) -> None:
        """num_train_epochs -> all_steps, from the number of training prompts and ranks (every rank calls this with
        the same numbers): a step takes world x grad_accum x train_batch_groups groups, a round trains mu steps."""
        if self.num_train_epochs is None:
            return
        per_step = max(1, world * self.grad_accum * self.train_batch_groups)
        self.all_steps = max(1, math.ceil(self.num_train_epochs * prompts / per_step) * self.mu)
        self.resolve_warmup()
