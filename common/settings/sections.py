"""The sections of `trainer/main.py --help`: (title, one line about it, GRPOConfig field names), in order.

A field no section names still shows, under "other settings" (common/settings/knobs.py); tests/test_config.py fails
while that group is not empty, so a new field gets its section here.
"""
from __future__ import annotations

SECTIONS: list[tuple[str, str, list[str]]] = [
    ("model and data", "What is trained, on what, and how a row becomes a prompt.", [
        "model", "ref_model", "trust_remote_code", "attn_implementation", "revision", "model_init_kwargs",
        "data", "dataset_config", "data_split", "eval_data", "eval_split", "data_limit", "prompt_format",
        "prompt_column", "answer_column",
        "prompt_template", "system_prompt", "chat_template_kwargs"]),
    ("rewards", "Reward functions and their shaping.", [
        "reward_fns", "reward_weights", "reward_timeout", "reward_processing_classes", "reward_model_timeout",
        "overlong_buffer", "overlong_penalty"]),
    ("generation", "Rollouts: group size, lengths, sampling and the engine of the genonly workers.", [
        "num_pre_Q", "Q_batch_size", "max_prompt_length", "max_new_tokens", "temperature", "top_p", "top_k",
        "min_p", "repetition_penalty", "generation_kwargs",
        "gen_backend", "gen_batch_size", "compute_gen_logps", "worker_dtype", "vllm_dtype", "vllm_eager",
        "vllm_enable_prefix_caching",
        "vllm_max_model_len", "vllm_gpu_memory_utilization", "vllm_kv_cache_gb", "vllm_cpu_threads_bind",
        "vllm_tensor_parallel_size"]),
    ("tools", "Multi-turn rollouts: tools the model calls while it generates (docs/tools.md).", [
        "tools", "environment_factory", "max_tool_calling_iterations", "tool_timeout", "tool_output_chars"]),
    ("agents", "Your own agent program as the rollout, against the worker's OpenAI-compatible endpoint "
               "(docs/agents.md).", ["agent", "agent_timeout", "agent_max_concurrency"]),
    ("objective", "The GRPO loss: KL, clipping, advantages, aggregation, off-policy correction, variants.", [
        "beta", "loss_type", "eps_low", "eps_high", "advantage_mode", "aggregation", "mu", "mask_truncated",
        "train_zero_spread", "logp_temperature", "old_logps", "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "tis_cap", "use_bias_correction_kl", "importance_sampling_level", "gspo_eps_low", "gspo_eps_high",
        "sapo_temperature_pos", "sapo_temperature_neg", "top_entropy_quantile", "off_policy_mask_threshold"]),
    ("optimisation", "Optimizer, schedule, batch shape per update, memory and precision.", [
        "lr", "lr_schedule", "warmup_steps", "warmup_ratio", "weight_decay", "grad_clip", "grad_accum",
        "train_batch_groups", "micro_batch_size", "zero_stage", "bf16", "gradient_checkpointing", "ds_config",
        "logp_chunk_tokens", "padding_free", "pack_tokens"]),
    ("LoRA", "Adapters instead of full fine-tuning.", [
        "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"]),
    ("run, checkpoints, eval and logs", "How long, where things go, when to evaluate and log.", [
        "all_steps", "num_train_epochs", "seed", "output_dir", "save_steps", "save_strategy", "save_total_limit",
        "resume", "eval_steps", "eval_before", "eval_limit", "eval_max_new_tokens", "log_every", "wandb", "report_to",
        "wandb_project", "run_name",
        "log_completions", "log_completions_steps", "num_completions_to_print", "log_stall_every"]),
    ("workers and sync", "The ref server, genonly workers and the policy weights they get.", [
        "ref_server", "ref_token", "ref_timeout", "num_gen_workers", "get_wait", "max_staleness", "sync_steps",
        "sync_delta", "sync_delta_max_share", "sync_dir", "worker_rounds", "worker_max_queued", "worker_id",
        "device", "weight_fetch_retries", "wait_for_ranks", "wait_for_ranks_timeout", "start_after",
        "gen_wait_for_workers"]),
    ("health", "Stalls, dead peers and bad batches: found, named, stopped.", [
        "stall_warn", "stall_timeout", "max_rejected_batches", "max_skipped_prompts", "none_reward_groups",
        "max_no_spread_groups", "dist_timeout", "heartbeat_s"]),
]
