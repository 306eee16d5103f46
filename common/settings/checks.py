"""What values GRPOConfig (common/config.py) accepts: `validate()` checks every field and raises one ValueError
("config: ...") naming the first that is wrong. A mixin, so that common/config.py reads as the list of knobs and
this file as their rules; a new field's check goes here, in the group of its section.
"""
from __future__ import annotations

from typing import TypeVar

from common.settings.knobs import parse_choices
from common.settings.reward_models import RewardModels
from common.settings.reward_sources import RewardSources
from common.settings.tool_specs import tool_spec_errors

# TRL loss_type -> (policy term, our aggregation). TRL's bnpo normalises by the local batch's tokens = token_mean.
LOSS_TYPES = {"grpo": ("clip", "seq_mean"), "bnpo": ("clip", "token_mean"), "dr_grpo": ("clip", "dr_grpo"),
              "dapo": ("clip", "dapo"), "cispo": ("cispo", "dapo"), "sapo": ("sapo", "seq_mean"),
              "luspo": ("clip", "luspo")}
# Files `data` and `eval_data` may name (trainer/data/files.py reads them); such a file has no splits.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".csv", ".parquet")

C = TypeVar("C", bound="ConfigChecks")


class ConfigChecks(RewardSources, RewardModels):
    """GRPOConfig's validation (mixed into it; every attribute named here is a GRPOConfig field); reward_specs()
    and env_reward_names() come with it (reward_sources.py)."""

    def reporters(self) -> set[str]:
        """report_to (+ the wandb flag) as a set of tensorboard/wandb; metrics.jsonl is always written."""
        names = self._report_names()
        out = {"tensorboard", "wandb"} if "all" in names else names - {"none"}
        return out | ({"wandb"} if self.wandb else set())

    def _report_names(self) -> set[str]:
        names = self.report_to if isinstance(self.report_to, list) else str(self.report_to).split(",")
        return {str(n).strip().lower() for n in names if str(n).strip()}

    def validate(self: C) -> C:
        choice_errors = parse_choices(self)  # the multi-valued knobs, from their types: before any check reads them
        if choice_errors:
            raise ValueError(f"config: {choice_errors[0]}")
        self.resolve_warmup()  # against the final all_steps (every source merged); num_train_epochs: at train time
        checks = self.trl_checks() + [
            (self.num_pre_Q >= 2, "num_pre_Q must be >= 2 (a group needs a spread)"),
            (self.Q_batch_size == "auto" or self.Q_batch_size >= 1, "Q_batch_size must be >= 1 (or auto)"),
            (self.gen_batch_size == "auto" or self.gen_batch_size >= 1, "gen_batch_size must be >= 1 (or auto)"),
            (self.beta >= 0, "beta must be >= 0"),
            (0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low in [0,1) and eps_high >= 0"),
            (self.mu >= 1, "mu must be >= 1"),
            (self._report_names() <= {"none", "tensorboard", "wandb", "all"}
             and not ("none" in self._report_names() and len(self._report_names()) > 1),
             f"report_to must be none, tensorboard, wandb or all (or a list of them), got {self.report_to!r}"),
            (self.log_completions_steps >= 1, "log_completions_steps must be >= 1"),
            (self.num_completions_to_print is None or self.num_completions_to_print >= 0,
             "num_completions_to_print must be >= 0 (or None: all)"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature > 0, "temperature must be > 0"),
            (self.zero_stage in (None, 0, 1, 2, 3), "zero_stage must be 0..3"),
        ]
        checks += [  # --- issue 11 ---
            (self.save_total_limit >= 0, "save_total_limit must be >= 0 (0 = keep every checkpoint)"),
            (self.save_steps >= 1, "save_steps must be >= 1"),
            (self.log_stall_every > 0, "log_stall_every must be > 0"),
        ]
        checks += self._check_data_and_rewards()
        checks += [(False, msg) for msg in tool_spec_errors(self.tools, self.environment_factory)] + [  # issue 32
            (self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
             "max_tool_calling_iterations must be >= 0 (or null = no limit)"),
            (self.tool_timeout > 0, "tool_timeout must be > 0 seconds"),
            (self.tool_output_chars >= 50, "tool_output_chars must be >= 50 (room for the truncation note)"),
        ] + [(False, msg) for msg in self.agent_errors()]  # issue 61
        checks += [  # --- generation engine / mismatch (issue 12) ---
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.vllm_max_model_len is None or self.vllm_max_model_len >= 2, "vllm_max_model_len must be >= 2"),
            (self.vllm_gpu_memory_utilization == "auto" or 0 < self.vllm_gpu_memory_utilization <= 1,
             "vllm_gpu_memory_utilization must be in (0, 1] (or auto)"),
            (self.vllm_kv_cache_gb > 0, "vllm_kv_cache_gb must be > 0"),
            (self.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size must be >= 1 (GPUs per vLLM worker)"),
            (self.tis_cap is None or self.tis_cap >= 1, "tis_cap must be >= 1 (or null = off)"),
            (self.tis_cap is None or self.compute_gen_logps, "tis_cap needs compute_gen_logps (engine logprobs)"),
        ]
        checks += self._check_objective()
        checks += [  # --- LoRA and GRPO variants (issue 14) ---
            (self.lora_r >= 0, "lora_r must be >= 0 (0 = full fine-tuning)"),
            (self.lora_r == 0 or self.lora_alpha > 0, "lora_alpha must be > 0"),
            (0 <= self.lora_dropout < 1, "lora_dropout must be in [0, 1)"),
            (self.lora_r == 0 or (bool(self.lora_target_modules)
                                  and all(isinstance(m, str) and m for m in self.lora_target_modules)),
             "lora_target_modules must be a non-empty list of module names"),
            (0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0, "gspo_eps_low in [0,1) and gspo_eps_high >= 0"),
            (0 <= self.overlong_buffer <= self.max_new_tokens, "overlong_buffer must be in [0, max_new_tokens]"),
            (self.overlong_penalty >= 0, "overlong_penalty must be >= 0"),
        ]
        checks += [  # --- run health (issue 16) ---
            (self.stall_warn > 0, "stall_warn must be > 0 seconds"),
            (self.stall_timeout >= 0, "stall_timeout must be >= 0 seconds (0 = never)"),
            (self.max_rejected_batches >= 0, "max_rejected_batches must be >= 0 (0 = never stop for them)"),
            (self.dist_timeout > 0, "dist_timeout must be > 0 seconds"),
            (self.heartbeat_s > 0, "heartbeat_s must be > 0 seconds"),
            (self.micro_batch_size is None or self.micro_batch_size >= 0,
             "micro_batch_size must be >= 0 rows (0 = the whole batch at once; null = picked to fit)"),
            (self.weight_fetch_retries >= 0, "weight_fetch_retries must be >= 0"),
            (self.wait_for_ranks >= 0, "wait_for_ranks must be >= 0 (0 = do not wait)"),
            (self.wait_for_ranks_timeout > 0, "wait_for_ranks_timeout must be > 0 seconds"),
            (isinstance(self.pack_tokens, int) and not isinstance(self.pack_tokens, bool) and self.pack_tokens >= 1,
             f"pack_tokens must be an integer >= 1 (tokens of one packed forward), got {self.pack_tokens!r}"),
        ]
        extra = sorted(set(self.load_options()) - {"trust_remote_code", "revision", "attn_implementation"})
        checks += self.loading_checks() + [  # --- issue 31: how every process loads the model ---
            (self.gen_backend != "vllm" or not extra,
             f"model_init_kwargs {extra} reach HF from_pretrained only: vLLM workers (gen_backend vllm) would load "
             f"a different model; with vLLM give only trust_remote_code, revision, attn_implementation"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"config: {msg}")
        return self

    def _check_objective(self) -> list[tuple[bool, str]]:
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        return [
            (self.old_logps == "trainer" or self.compute_gen_logps,
             "old_logps engine takes π_old from the engine's logprobs: it needs compute_gen_logps true"),
            (hi is None or hi > 0, "vllm_importance_sampling_clip_max must be > 0 (or null)"),
            (lo is None or lo >= 0, "vllm_importance_sampling_clip_min must be >= 0 (or null)"),
            (lo is None or hi is None or lo < hi, "vllm_importance_sampling_clip_min must be < clip_max"),
            (self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
             "off_policy_mask_threshold must be >= 0 (or null = off)"),
            (self.grad_accum >= 1, "grad_accum must be >= 1"),
            (self.loss_type is None or self.loss_type in LOSS_TYPES,
             f"unknown loss_type {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)} (or null)"),
            (self.loss_type is None or self.aggregation in ("seq_mean", LOSS_TYPES.get(self.loss_type, ("", ""))[1]),
             f"loss_type {self.loss_type} sets aggregation {LOSS_TYPES.get(self.loss_type, ('', ''))[1]}, but "
             f"aggregation {self.aggregation} is given: give one of them"),
            (self.loss_type != "cispo" or self.eps_high >= 1,
             "loss_type cispo caps the IS weight at eps_high (TRL's epsilon_high, the absolute ε_max): set it "
             f">= 1, e.g. 5.0 (got {self.eps_high})"),
            (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo temperatures must be > 0"),
            (0 <= self.top_entropy_quantile <= 1, "top_entropy_quantile must be in [0, 1] (as TRL's)"),
            (self.logp_temperature in (None, 1, 1.0) or self.logp_temperature == self.temperature,
             f"logp_temperature must be null (the sampling temperature) or 1 (the raw distribution): the engines "
             f"return logprobs of one of those two, got {self.logp_temperature!r}"),
        ]

    def _check_data_and_rewards(self) -> list[tuple[bool, str]]:
        # reward_specs() may import the environment class (reward_fns null): only when weights need counting
        n_fns = len(self.reward_specs()) if self.reward_weights else 0
        return [(False, msg) for msg in self.reward_source_errors() + self.reward_model_errors()] + [
            (self.dataset_config is None or (isinstance(self.dataset_config, str) and self.dataset_config.strip()),
             "dataset_config must be a configuration name (or null)"),
            (not (self.eval_steps or self.eval_before) or self.eval_data
             or not str(self.data).lower().endswith(DATA_FILE_SUFFIXES),
             f"eval_steps/eval_before evaluate on held-out rows, but data {self.data!r} is one file with no eval "
             f"split: give eval_data (a file, folder or hub id), or set eval_steps 0 and eval_before false"),
            (self.prompt_format not in ("raw", "r1zero", "trl") or self.system_prompt in ("default", "", None),
             f"prompt_format {self.prompt_format!r} takes the prompt as it is: a system_prompt cannot be added "
             f"(set system_prompt to '')"),
            (not self.reward_weights or len(self.reward_weights) == n_fns,
             f"reward_weights has {len(self.reward_weights)} values for {n_fns} reward_fns"),
            (all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights),
             f"reward_weights must be numbers, got {self.reward_weights!r}"),
            (self.reward_timeout >= 0, "reward_timeout must be >= 0 (0 = no timeout)"),
        ]
