"""GRPOConfig: one dataclass for every knob of the trainer and its workers, each documented.

    cfg = load_config(GRPOConfig, ["--config", "configs/demo.json", "--lr", "1e-4"])  # common/settings/knobs.py

Every field carries a `help` string; `--help` prints them all. The same machinery serves ref_server/config.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from common.settings.agent_options import AgentOptions
from common.settings.checks import LOSS_TYPES, ConfigChecks
from common.settings.choices import (
    AdvantageMode,
    Aggregation,
    GenBackend,
    ISLevel,
    LrSchedule,
    OnOffAuto,
    PromptFormat,
    VllmDtype,
    WorkerDtype,
)
from common.settings.generation_options import GenerationOptions
from common.settings.knobs import knob
from common.settings.model_options import ModelLoading
from common.settings.objective_options import ObjectiveOptions
from common.settings.save_options import Saving
from common.settings.sections import SECTIONS
from common.settings.spin import SpinLimits
from common.settings.start_options import StartOrder
from common.settings.tool_options import ToolOptions
from common.settings.trl_options import TRLOptions


@dataclass
class GRPOConfig(ModelLoading, TRLOptions, ToolOptions, AgentOptions, GenerationOptions, ObjectiveOptions,
                 StartOrder, SpinLimits, Saving, ConfigChecks):
    """Every option of the trainer ranks and the genonly workers (common/config.py). Defaults <- the JSON
    file given by --config <- flags. TRL GRPOConfig names are accepted too (listed at the end; docs/trl.md).
    validate() and the rules it checks: common/settings/checks.py; more fields: the mixins of common/settings/."""

    ACCEPTS_TRL_NAMES: ClassVar[bool] = True  # TRL GRPOConfig names map onto ours (common/settings/trl_aliases.py)
    HELP_SECTIONS: ClassVar[list] = SECTIONS  # --help groups (common/settings/sections.py)
    # (trust_remote_code, attn_implementation, revision, model_init_kwargs: common/settings/model_options.py;
    # tools, environment_factory, max_tool_calling_iterations, tool_timeout, tool_output_chars: tool_options.py;
    # save_strategy: save_options.py; old_logps, the IS correction, loss_type and its family: objective_options.py)

    # --- model and data -------------------------------------------------------------
    model: str = knob("tiny", "Policy model: a Hugging Face id or local directory. 'tiny' builds/caches the "
                              "embedded tiny Qwen2 model (common/tiny_model.py).")
    ref_model: str | None = knob(None, "Reference model for the ref server (defaults to `model`).")
    data: str = knob("openai/gsm8k", "Training data: a hub id (datasets.load_dataset), a directory with "
                                     "{split}.jsonl/.json/.csv/.parquet, or one .jsonl, .json (array or lines), "
                                     ".json.gz or .csv or .parquet file. 'arith' = the built-in synthetic "
                                     "arithmetic task. Rows without an answer column are prompt-only (ground "
                                     "truth None; docs/data.md).")
    dataset_config: str | None = knob(None, "TRL name: the configuration (subset) of a hub dataset, or of a "
                                            "dataset folder whose README.md lists `configs:` (openai/gsm8k "
                                            "gets 'main' without it). Applies to data and eval_data.")
    data_split: str = knob("train", "Split used for training.")
    eval_split: str = knob("test", "Split used for evaluation.")
    eval_data: str | None = knob(None, "Eval data for eval_steps/eval_before, in the forms `data` takes (a "
                                       "folder or hub id gives its eval_split). Default: data's eval_split; a "
                                       "single-file data has none: eval never runs on training rows.")
    data_limit: int | None = knob(None, "Use at most this many training examples.")
    system_prompt: str | None = knob("default", "System prompt for the chat template; 'default' = the R1-style "
                                                    "prompt in common/prompts.py; '' = no system message (a template "
                                                    "with a default, like Qwen2.5's, still inserts its own); "
                                                    "'none' = no system turn at all (cut out of the template's "
                                                    "output; an error where the template does not allow it).")
    reward_fns: list | None = knob(None, "Rewards per completion: built-ins, dotted paths, reward models (docs/reward_"
                                         "models.md); null: correct,format, or none if an environment has get_reward()")
    # --- ref server -----------------------------------------------------------------
    ref_server: str = knob("http://127.0.0.1:59875", "Ref server URL (comma-separated list to spread uploads).")
    ref_token: str | None = knob(None, "Bearer token for the ref server (or set GRPO_REF_TOKEN).")
    ref_timeout: float = knob(30.0, "Seconds an HTTP call to the ref server may take.")
    num_gen_workers: int = knob(0, "How many genonly workers feed the server. 0 = trainer ranks generate "
                                   "themselves whenever no scored batch is ready.")
    sync_steps: int = knob(1, "With genonly workers: rank 0 publishes the policy weights every N optimizer steps "
                              "(0 = never: workers keep their initial weights, as in simple_GRPO).")
    sync_delta: bool = knob(True, "Weight sync sends only what changed since the last version (per tensor: "
                                  "changed positions + values, a bitmask + values, or the whole tensor, whichever "
                                  "is smallest; bit-exact, checksum-checked); workers one version behind fetch the "
                                  "delta, others the full copy. false = full copies every time. HTTP only "
                                  "(sync_dir always writes full copies); LoRA runs send adapters as before.")
    sync_delta_max_share: float = knob(0.15, "With sync_delta: a delta estimated (from a sample of every tensor) "
                                             "over this share of the full weights goes as the full copy instead: "
                                             "bitmask deltas cost more CPU to encode and apply than they save in "
                                             "bytes over a fast link. Raise it (up to 1) when the link is slow.")
    sync_dir: str | None = knob(None, "Publish weights through this shared directory instead of the ref "
                                         "server (HTTP works across nodes with no shared filesystem).")
    max_staleness: int = knob(2, "Drop (and count) scored batches generated by a policy more than this many "
                                 "versions older than the one being trained. Not applied to worker batches "
                                 "when sync_steps=0 (workers never get new weights, so versions say nothing).")
    get_wait: float = knob(2.0, "With genonly workers: seconds a rank waits for a scored batch before it "
                                "generates one itself (0 = wait for workers only).")
    # --- GRPO -----------------------------------------------------------------------
    num_pre_Q: int = knob(8, "Completions sampled per question (group size).")
    train_batch_groups: int = knob(1, "Scored batches (groups) concatenated into one training batch.")
    max_prompt_length: int = knob(512, "Prompts longer than this (tokens) are skipped and counted.")
    max_new_tokens: int = knob(512, "Maximum completion length.")
    temperature: float = knob(0.9, "Sampling temperature for rollouts.")
    logp_temperature: float | None = knob(None, "Temperature of the training, reference and engine logprobs "
                                                "(logits / T). null = the sampling temperature: logprobs of the "
                                                "distribution the rollouts came from (TRL, verl). 1 = the raw "
                                                "distribution (simple_GRPO). Other values are refused.")
    top_p: float = knob(1.0, "Nucleus sampling for rollouts.")
    beta: float = knob(0.04, "KL coefficient (k3 estimator against the reference model). 0 disables the ref "
                             "logprob computation on the server.")
    eps_low: float = knob(0.2, "Lower clip epsilon of the policy ratio.")
    eps_high: float = knob(0.2, "Upper clip epsilon of the policy ratio (raise for DAPO-style clip-higher).")
    compute_gen_logps: bool = knob(True, "Upload the engine's generation-time logprobs (used by the importance-"
                                         "sampling correction, or as π_old with old_logps engine). False: none "
                                         "are computed; π_old is the trainer's first pass (ratio 1, then clipped "
                                         "over mu passes), no correction.")
    advantage_mode: AdvantageMode = knob("grpo", "grpo (r-mean)/std, grpo_no_std (r-mean), grpo_batch_std (r - group "
                                                 "mean) / std of the generation round's rewards (TRL "
                                                 "scale_rewards=batch), raw (r) or reinforce_pp "
                                                 "(REINFORCE++-baseline, arXiv:2501.03262: r - group mean, "
                                                 "normalised over the whole step batch).")
    aggregation: Aggregation = knob("seq_mean", "Loss aggregation: seq_mean (simple_GRPO), token_mean (= TRL bnpo), "
                                                "dr_grpo, dapo (token sum / the global batch's token count) or luspo "
                                                "(token sum per completion, mean over completions).")
    mu: int = knob(1, "Optimizer updates (steps) per generation round (TRL num_iterations): a round's batches are "
                      "trained for mu consecutive steps, clipped against their first pass.")
    mask_truncated: bool = knob(False, "Drop completions that hit max_new_tokens without EOS from the loss.")
    # --- optimisation ---------------------------------------------------------------
    lr: float = knob(1e-6, "Peak learning rate (AdamW).")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    lr_schedule: LrSchedule = knob("constant", "constant, linear (decay to 0 at all_steps, TRL's default) or cosine; "
                                               "all with linear warmup.")
    warmup_steps: int = knob(0, "Linear warmup steps.")
    grad_clip: float = knob(1.0, "Gradient norm clip.")
    grad_accum: int = knob(1, "Training batches (each train_batch_groups groups) whose gradients make one optimizer "
                              "update: a step fetches grad_accum batches per rank (DeepSpeed accumulation).")
    micro_batch_size: int | None = knob(None, "Rows (completions) per forward/backward on a rank: the training batch "
                                              "is split into micro-batches whose gradients are accumulated into ONE "
                                              "optimizer update per step, with the same gradient as the whole batch "
                                              "for every aggregation (trainer/objective/microbatch.py). 0 = the whole "
                                              "batch at once. null (unset) = the whole batch on CPU; on GPUs the "
                                              "largest that fits the memory estimate (docs/gpus.md). TRL: "
                                              "per_device_train_batch_size.")
    zero_stage: int | None = knob(None, "Override the ZeRO stage of ds_config (2 by default; 3 works).")
    bf16: bool | Literal["auto"] | None = knob(None, "Ranks in bf16 under DeepSpeed (bf16 weights, fp32 master copy "
                                                     "and Adam state): true/false override ds_config's bf16.enabled; "
                                                     "auto: on CPU where it runs bf16 natively (AVX-512 BF16 or AMX, "
                                                     "not capped by ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA), on GPUs "
                                                     "that have it (common/settings/precision.py); null keeps "
                                                     "ds_config's (ds_config.json: auto = on GPUs with bf16).")
    gradient_checkpointing: bool | None = knob(None, "Recompute activations in backward to save memory. null (unset) = "
                                                     "off on CPU; on GPUs on only where no micro-batch fits without it "
                                                     "(the memory estimate, docs/gpus.md).")
    ds_config: str = knob("ds_config.json", "DeepSpeed config file (batch, precision and optimizer fields "
                                            "are filled from this config).")
    logp_chunk_tokens: int = knob(1024, "Positions per chunk in the per-token logprob computation "
                                        "(bounds the B x chunk x V logits held at once).")
    padding_free: OnOffAuto = knob("auto", "Padding-free logprob forwards (the ranks' training forward and backward, "
                                           "the generation-time logprob pass): a micro-batch's rows as ONE packed "
                                           "sequence, position_ids restarting per row, attention confined to each "
                                           "row (common/packing.py); false pads to the longest row and groups rows "
                                           "of similar length into micro-batches. auto: per batch, whichever an "
                                           "estimate of the work both ways says is less (common/pack_choice.py, "
                                           "docs/benchmarks.md).")
    pack_tokens: int = knob(4096, "padding_free: the most tokens (prompt + completion, summed over rows) of one packed "
                                  "forward; a micro-batch's rows go into packs of up to this many (a longer row "
                                  "alone), one forward each, the same logprobs and gradient. Bounds memory (and the "
                                  "dense N x N mask of an eager-attention model's packs). The ref "
                                  "server bounds its forwards by its own score_token_budget.")
    # --- run ------------------------------------------------------------------------
    all_steps: int = knob(1000, "Training steps = optimizer updates (the LR schedule, versions, staleness, "
                                "publishes, metrics rows and checkpoints count them).")
    save_steps: int = knob(200, "Save an HF checkpoint every N steps (and at the end).")
    eval_steps: int = knob(0, "Evaluate every N steps (0 = never during training).")
    eval_before: bool = knob(False, "Evaluate the base model before training.")
    eval_limit: int = knob(200, "Examples per evaluation.")
    eval_max_new_tokens: int | None = knob(None, "Max new tokens in evaluation (default max_new_tokens).")
    seed: int = knob(42, "Random seed (rank/worker offsets are added).")
    output_dir: str = knob("runs/grpo", "Where checkpoints, metrics.jsonl and TensorBoard logs go.")
    resume: bool = knob(False, "Continue from the last DeepSpeed checkpoint in output_dir.")
    wandb: bool = knob(False, "Also log to Weights & Biases (must be installed); the same as report_to wandb.")
    report_to: list = knob(["tensorboard"], "TRL's name: where metrics go besides metrics.jsonl (always written): "
                                            "none, tensorboard, wandb or all (a list, or names comma-separated).")
    wandb_project: str = knob("grpo", "W&B project (report_to wandb).")
    run_name: str | None = knob(None, "W&B run name (default: the output_dir folder's name).")
    log_completions: bool = knob(False, "TRL's name: rank 0 appends the trained completions to "
                                        "output_dir/completions.jsonl (step, prompt, completion, rewards per "
                                        "function, advantage, policy_version, producer) and prints some as a table.")
    log_completions_steps: int = knob(1, "With log_completions: log every N steps.")
    num_completions_to_print: int | None = knob(None, "With log_completions: rows printed per logged step "
                                                      "(None = all, as TRL; 0 = none; the file gets all).")
    log_every: int = knob(1, "Write a metrics row every N steps.")
    worker_rounds: int = knob(0, "genonly: stop after this many generation rounds (0 = run until stopped).")
    worker_max_queued: int = knob(8, "genonly: pause while the server already holds this many batches "
                                     "(queued + scored): rollouts stay fresh instead of piling up stale.")
    worker_id: int = knob(0, "genonly: this worker's index (seeds and prompt shard; launch.sh sets it).")
    device: str = knob("auto", "genonly/eval device: auto, cpu or cuda:N (trainer ranks use their local GPU).")
    # --- real checkpoints, real runs (issue 11) ---------------------------------------------
    train_zero_spread: bool = knob(False, "Also train on groups whose rewards are all equal (their advantages are "
                                          "0, so their loss is the KL term alone). Default: skip them (counted and "
                                          "logged every 30 s while nothing trains).")
    save_total_limit: int = knob(2, "Keep the newest N HF step_* checkpoints and the newest N DeepSpeed state "
                                    "tags (older ones are deleted; `final` is never counted). 0 = keep all.")
    worker_dtype: WorkerDtype = knob("auto", "genonly worker dtype: auto (bf16 on CUDA; on CPU the ranks' precision: "
                                             "bfloat16 with bf16 true or auto-resolved true, else float32), "
                                             "bfloat16 or float32. Rank 0 publishes weights in this dtype when it is "
                                             "not auto, so bfloat16 halves the worker, the relay and each publish.")
    log_stall_every: float = knob(30.0, "While nothing trains (all groups skipped), log cumulative rollout "
                                        "counts every this many seconds.")
    # --- data, prompts and rewards (issue 13; reward_timeout from issue 16) ------------------------------
    prompt_format: PromptFormat = knob("auto", "How a prompt becomes model input: auto (messages where the prompt "
                                               "column holds a message list, else chat), chat (question + system "
                                               "prompt through the chat template), messages (the row's prompt is a "
                                               "[{role, content}] conversation, templated as is), raw (the prompt "
                                               "string verbatim, already templated, e.g. ReasonRL), r1zero "
                                               "(plain-text R1-Zero template, base models). See "
                                               "trainer/data/prompt_formats.py.")
    prompt_column: str | None = knob(None, "Dataset column holding the prompt (default: detected: prompt, "
                                           "question or problem).")
    answer_column: str | None = knob(None, "Dataset column(s) holding the answer (default: detected: "
                                           "ground_truth, answer (GSM8K ####), solution (MATH \\boxed{}), "
                                           "nums,target (Countdown); none of them: prompt-only rows, ground "
                                           "truth None). 'a,b' passes several as a JSON object.")
    prompt_template: str | None = knob(None, "Build the prompt from the row's columns with str.format, e.g. "
                                             "'Using {nums}, make {target}.' (Countdown has no prompt column).")
    reward_weights: list = knob([], "One weight per reward function (default: all 1.0).")
    reward_timeout: float = knob(10.0, "Seconds one reward function may take on one group (a call covering a "
                                       "round's groups gets this per group; ours-signature: per completion); "
                                       "past it the call counts as not applicable (None) and reward_timeouts is "
                                       "counted. Rewards run in a worker process killed on timeout. 0 = "
                                       "in-process, no timeout.")
    # --- generation engine (vLLM) and train/inference mismatch ------------------------
    gen_backend: GenBackend = knob("hf", "Generation engine of genonly workers and trainer.evaluate: hf "
                                         "(transformers generate), vllm, or auto: on CPU the one measured cheaper at "
                                         "the model's shape on this kind of CPU (common/placement/gen_choice.py), hf "
                                         "on CUDA. Trainer ranks' own fallback rollouts and in-training eval stay on "
                                         "HF.")
    top_k: int = knob(0, "Top-k sampling for rollouts (0 = off). Rollouts and eval sample exactly temperature/"
                         "top_p/top_k: the checkpoint's generation_config (repetition_penalty, ...) is ignored.")
    vllm_dtype: VllmDtype = knob("auto", "vLLM weights dtype: auto (on CPU the ranks' precision: bfloat16 with bf16 "
                                         "true/auto-resolved true, else float32; on CUDA the checkpoint's), "
                                         "bfloat16, float16 or float32 (float32 for exact logprob agreement with the "
                                         "trainer).")
    vllm_max_model_len: int | None = knob(None, "vLLM max model length (prompt + completion); default "
                                                "max_prompt_length + max_new_tokens.")
    vllm_tensor_parallel_size: int = knob(1, "TRL name: GPUs one vLLM worker spans (vLLM's tensor_parallel_size, "
                                             "for a model too big for one GPU). launch.sh's placement gives each "
                                             "worker this many GPUs of its own (docs/gpus.md).")
    vllm_kv_cache_gb: int = knob(1, "vLLM KV cache space in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE, unless set).")
    vllm_cpu_threads_bind: str = knob("nobind", "VLLM_CPU_OMP_THREADS_BIND on CPU (unless set): 'nobind' lets "
                                                "the OS place threads, right when other processes share cores; "
                                                "'auto' or a core list like '0-1' pins them.")
    tis_cap: float | None = knob(None, "Deprecated: --tis_cap C = vllm_importance_sampling_mode token_truncate "
                                       "with vllm_importance_sampling_clip_max C (the former truncated IS).")
    # --- LoRA and GRPO variants (issue 14) -------------------------------------------
    lora_r: int = knob(0, "LoRA rank (peft). 0 = full fine-tuning. > 0: only the adapters train; workers get "
                          "adapter-only weight syncs; checkpoints are adapters plus a merged model at the end.")
    lora_alpha: float = knob(16.0, "LoRA alpha: the update is scaled by lora_alpha / lora_r.")
    lora_dropout: float = knob(0.0, "Dropout on the LoRA input (training only).")
    lora_target_modules: list = knob(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     "Module names that get LoRA adapters (default: attention and MLP projections).")
    importance_sampling_level: ISLevel = knob("token", "token: one ratio per token (GRPO). sequence: GSPO "
                                                       "(arXiv:2507.18071), one length-normalised ratio per "
                                                       "completion, clipped with gspo_eps_low/gspo_eps_high.")
    gspo_eps_low: float = knob(3e-4, "GSPO lower clip epsilon of the sequence ratio (paper: 3e-4).")
    gspo_eps_high: float = knob(4e-4, "GSPO upper clip epsilon of the sequence ratio (paper: 4e-4).")
    overlong_buffer: int = knob(0, "DAPO overlong shaping (arXiv:2503.14476): length of the soft punishment zone "
                                   "before max_new_tokens, in tokens (0 = off).")
    overlong_penalty: float = knob(1.0, "DAPO overlong shaping: reward penalty at max_new_tokens, linear from 0 "
                                        "at max_new_tokens - overlong_buffer.")
    # --- run health: status view, timeouts, weight integrity (issue 16) ----------------
    stall_warn: float = knob(120.0, "A participant (worker, rank) silent at the ref server for longer than this "
                                    "many seconds is listed as stalled in GET /status; rank 0 logs it.")
    stall_timeout: float = knob(1800.0, "A rank that made no optimizer step for this many seconds stops with a "
                                        "non-zero exit and a diagnosis (what it waited for, who is stalled). "
                                        "0 = never.")
    max_rejected_batches: int = knob(64, "A rank that rejects this many scored batches in a row (none usable in "
                                         "between: wrong temperature, vocabulary, lengths) stops with exit 5 and "
                                         "the last reason, instead of waiting for usable ones forever. 0 = never.")
    dist_timeout: float = knob(600.0, "Timeout in seconds of the distributed process group (torch's default is "
                                      "30 min): a rank whose peer died leaves a collective after this, naming it.")
    heartbeat_s: float = knob(10.0, "Ranks and workers send a heartbeat to the ref server this often (seconds) "
                                    "while they have nothing else to say.")
    wait_for_ranks: int = knob(0, "genonly: build the generation engine only once this many trainer ranks are "
                                  "ready (have sent their first heartbeat to the ref server: engine built, first "
                                  "weights published). launch.sh sets it for a vLLM worker that shares a GPU with "
                                  "a rank: vLLM's memory profiling fails if another process frees GPU memory "
                                  "meanwhile (docs/gpus.md). 0 = start at once.")
    wait_for_ranks_timeout: float = knob(1800.0, "genonly: seconds to wait for those ranks before the worker "
                                                 "exits non-zero, saying which are missing.")
    weight_fetch_retries: int = knob(5, "genonly: a weight download that breaks or fails its checksum is retried "
                                        "this many times (the worker keeps its current weights meanwhile).")

    def __post_init__(self) -> None:
        """Derived settings, at construction: the deprecated tis_cap spelling and loss_type's aggregation."""
        if self.tis_cap is not None and self.tis_cap >= 1 and self.compute_gen_logps:
            import logging
            logging.getLogger("config").warning(
                "tis_cap is deprecated: using vllm_importance_sampling_mode token_truncate, clip_max %s",
                self.tis_cap)
            self.old_logps, self.vllm_importance_sampling_correction = "trainer", True
            self.vllm_importance_sampling_mode = "token_truncate"
            self.vllm_importance_sampling_clip_max, self.tis_cap = self.tis_cap, None
        if self.loss_type in LOSS_TYPES and self.aggregation == "seq_mean":
            self.aggregation = LOSS_TYPES[self.loss_type][1]

    def objective(self) -> str:
        """The policy term of the loss: clip (PPO/GRPO/GSPO), cispo or sapo (from loss_type)."""
        return LOSS_TYPES[self.loss_type][0] if self.loss_type else "clip"

    def logprob_temperature(self) -> float:
        """The T every logprob of the objective is computed at (logp_temperature, null = temperature)."""
        return self.temperature if self.logp_temperature is None else float(self.logp_temperature)
