"""TRL 1.16 GRPOConfig / TrainingArguments knobs honoured under their TRL names (issue 40), mixed into GRPOConfig.

    use_bias_correction_kl   the KL term weighted by the importance ratio (trainer/objective/grpo.py)
    warmup_ratio             warmup_steps = ceil(ratio x the final step count), resolved once that count is known
    num_train_epochs         all_steps from the training set's size (trainer/loop.py, resolve_epochs)
    chat_template_kwargs     extra arguments of the chat template (Qwen3's enable_thinking)
    min_p, repetition_penalty, generation_kwargs   more sampling settings of rollouts, HF and vLLM engines alike

No torch here: config classes import this for --help and validation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.settings.knobs import knob

# Sampling settings the engines set themselves (from their own fields, or to keep samples and logprobs exact).
OWNED_SAMPLING = {"temperature", "top_p", "top_k", "max_new_tokens", "max_tokens", "max_length", "n",
                  "num_return_sequences", "do_sample", "logprobs", "stop_token_ids", "eos_token_id", "pad_token_id",
                  "bos_token_id", "detokenize", "seed", "output_scores", "return_dict_in_generate", "num_beams",
                  "use_cache", "logprobs_mode"}


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

    min_p: float | None = knob(None, "TRL name: min-p sampling in rollouts (tokens below min_p x the top token's "
                                     "probability are dropped), HF and vLLM engines alike. null/0 = off. The trainer's "
                                     "logprobs stay those of the temperature-scaled distribution (as TRL's).")
    repetition_penalty: float = knob(1.0, "TRL name: repetition penalty in rollouts (> 1 discourages tokens already "
                                          "in the prompt or completion), HF and vLLM engines alike. 1 = off.")
    generation_kwargs: dict = knob({}, "TRL name: more sampling settings of rollouts, passed as they are to "
                                       "transformers' GenerationConfig (HF engines) or vLLM's SamplingParams (vLLM "
                                       "workers), as TRL does; the keys we set ourselves (temperature, top_p, top_k, "
                                       "lengths, n, stop tokens, logprobs) are refused.")

    def sampling_extras(self) -> dict:
        """What rollouts sample with beyond temperature/top_p/top_k (given to both engines' sampling settings)."""
        out = {"repetition_penalty": float(self.repetition_penalty)}
        if self.min_p:
            out["min_p"] = float(self.min_p)
        return {**out, **(self.generation_kwargs or {})}

    def trl_checks(self) -> list[tuple[bool, str]]:
        owned = sorted(set(self.generation_kwargs or {}) & OWNED_SAMPLING) \
            if isinstance(self.generation_kwargs, dict) else []
        return [
            (self.min_p is None or 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (or null), got {self.min_p!r}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (isinstance(self.generation_kwargs, dict), "generation_kwargs must be a JSON object"),
            (not owned, f"generation_kwargs may not set {owned}: they have fields of their own (temperature, top_p, "
                        f"top_k, max_completion_length, num_generations) or are the engine's to set"),
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
