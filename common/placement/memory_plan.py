"""How much GPU memory each process of a run needs: an estimate from the model's config.json (no weights loaded).

The formula (docs/gpus.md, "Memory estimate", derives each term and compares it with measured peaks):

    rank        = weights + gradients + optimizer states (under the ZeRO stage and world size)
                  + max(activations + chunked LM-head logits at one micro-batch, the optimizer step's transients,
                        the KV cache of the ranks' own generation)
                  + ZeRO buffers + CUDA context and NCCL (RANK_CONTEXT)
    ref server  = weights (its dtype) + one forward's transients + CUDA context
    vLLM worker = vllm_gpu_memory_utilization x the GPU (what vLLM reserves; its weights must leave KV room)
    HF worker   = weights + KV cache of one generate call + its kept logits (or, past 256 MiB of them, the
                  larger of that cache and its logprob forward of one group) + CUDA context

Pure functions of a ModelShape and the run's settings; common/placement/memory_report.py reads the GPUs and prints it,
trainer/deepspeed_policy.py picks the GPU defaults (`pick`) when a run was started without the launcher's pick.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
CUDA_CONTEXT = GIB // 2  # CUDA context + cuBLAS workspace of one process (~0.5 GiB on an H100, CUDA 12)
# A DeepSpeed rank holds more outside torch's allocator: 1.65 GiB measured on an H200 (torch 2.11+cu130, NCCL 2.28,
# one rank; nvidia-smi minus max_memory_reserved, the same under ZeRO-2, ZeRO-3 and LoRA): the context, NCCL's
# communicator, library workspaces (docs/benchmarks.md, the GPU check). More ranks give NCCL more peers to buffer.
RANK_CONTEXT = int(1.65 * GIB)
FIT_SHARE = 0.9  # an estimate fits a GPU when it is under this share of it: the caching allocator fragments
# DeepSpeed's bucket defaults (elements) where ds_config leaves them out (runtime/zero/config.py)
DS_BUCKET = 500_000_000
DS_STAGE3_LIVE = 1_000_000_000
DS_STAGE3_PREFETCH = 50_000_000


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only causal LM (Qwen2/Llama/Mistral-like)."""
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, model: str) -> ModelShape:
        """From the model's config.json (a local directory, a hub id, or 'tiny'). A local Qwen2/Llama config.json
        that states every field is read as JSON: launch.sh's plan then needs neither torch nor transformers (~4.5
        s of each `--print-plan` on a GPU node); anything else goes through AutoConfig, which knows each model
        type's defaults (tests/test_memory_plan.py checks both give the same shape)."""
        from common.paths import resolve_model_path
        path = resolve_model_path(model)
        shape = cls._from_json(Path(path) / "config.json")
        if shape is not None:
            return shape
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(path)
        return cls._from_dict((getattr(c, "text_config", None) or c).to_dict())

    @classmethod
    def _from_json(cls, config_json: Path) -> ModelShape | None:
        """None unless the file is a qwen2/llama config with every field the shape needs: where one is left out,
        the default is the model class's (Qwen2Config's num_key_value_heads is 32, not the head count)."""
        if not config_json.is_file():
            return None
        c = json.loads(config_json.read_text())
        need = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings")
        if c.get("model_type") not in ("qwen2", "llama") or any(c.get(k) is None for k in need):
            return None
        return cls._from_dict(c)

    @classmethod
    def _from_dict(cls, c: dict) -> ModelShape:
        """config.json's fields (or AutoConfig's to_dict()); Qwen2 has q/k/v bias without saying so."""
        heads = c["num_attention_heads"]
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], intermediate=c["intermediate_size"],
                   vocab=c["vocab_size"], heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h  # + gate/up/down, + 2 RMSNorms

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Adapter parameters: r x (in + out) per targeted projection per layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(r * sum(dims[t]) for t in targets if t in dims)

    def act_bytes_per_token_layer(self, e: int) -> int:
        """Bytes one decoder layer keeps for backward per token (activations in e bytes; RMSNorm in float32)."""
        norms = 2 * (2 * e * self.hidden + 8 * self.hidden)  # input, output (e) + fp32 copy and normalised (fp32)
        attn = e * 5 * self.q_dim  # q, k and v repeated to all heads (GQA), attention output, o_proj's input
        mlp = e * 4 * self.intermediate  # gate, SiLU(gate), up, their product (down_proj's input)
        return norms + attn + mlp


@dataclass(frozen=True)
class TrainSettings:
    """The rank-side settings of the estimate (from GRPOConfig + ds_config + the plan)."""
    world: int
    stage: int
    bf16: bool
    micro_rows: int
    seq_len: int             # max_prompt_length + max_new_tokens: the longest row of a micro-batch
    completion_len: int      # max_new_tokens
    checkpointing: bool
    chunk_tokens: int        # logp_chunk_tokens
    lora_params: int = 0     # > 0: LoRA, only these train
    bucket: int = DS_BUCKET  # reduce bucket elements (stages 1, 2)
    overlap_comm: bool = False
    stage3_live: int = DS_STAGE3_LIVE
    stage3_prefetch: int = DS_STAGE3_PREFETCH
    generate_rows: int = 0   # ranks that generate their own rollouts (no genonly workers): HF generate's rows
    # torch AdamW's temporaries per stepped parameter: 4 with foreach (CUDA: sqrt(v), divided in place), 8 with the
    # single-tensor path (CPU: sqrt(v) and its quotient alive at once); ds_config.json asks for torch_adam
    adam_temp_bytes: int = 4


def logits_bytes(shape: ModelShape, e: int, rows: int, completion_len: int, chunk_tokens: int,
                 grad: bool) -> int:
    """One chunk of the chunked LM head (common/logprobs.py): rows x min(completion, chunk_tokens // rows)
    positions x vocab. Forward: e-byte logits, their fp32 copy, exp for logsumexp; backward adds their gradients
    (fp32 and e)."""
    positions = rows * min(completion_len, max(1, chunk_tokens // max(rows, 1)))
    return positions * shape.vocab * ((2 * e + 12) if grad else (e + 8))


def kv_cache_bytes(shape: ModelShape, e: int, rows: int, seq_len: int) -> int:
    return rows * seq_len * shape.layers * 2 * shape.kv_dim * e


def activation_bytes(shape: ModelShape, s: TrainSettings) -> int:
    """What one micro-batch's forward keeps for backward, at its peak, with the chunked LM head's logits."""
    e = 2 if s.bf16 else 4
    tokens = s.micro_rows * s.seq_len
    per_layer = shape.act_bytes_per_token_layer(e)
    if s.checkpointing:  # each layer's input kept, one layer's activations alive while it is recomputed
        act = tokens * (shape.layers * e * shape.hidden + per_layer)
    else:
        act = tokens * shape.layers * per_layer
    act += tokens * 3 * e * shape.hidden  # final norm's output, the hidden states' gradient, the picked states
    return act + logits_bytes(shape, e, s.micro_rows, s.completion_len, s.chunk_tokens, grad=True)


def step_bytes(shape: ModelShape, s: TrainSettings) -> int:
    """The optimizer step's transients: ZeRO 1-3 flatten the partition's gradient into a new fp32 tensor (stage 0
    in bf16: FP16_Optimizer's fp32 gradients), and Adam's sqrt(v) is a temporary as large as what it steps. ZeRO 1-3
    also hold one more gradient-sized copy (e bytes) at the step's peak: measured on CPU (docs/gpus.md, 0.9 GiB in
    bf16 and 1.8 GiB in fp32 for the 0.5B shape), not yet pinned to a tensor in DeepSpeed's code."""
    n = s.lora_params or shape.params()
    e = 2 if s.bf16 else 4
    if s.stage == 0:
        return int(n * ((4 if s.bf16 else 0) + s.adam_temp_bytes))
    return int(n / s.world * (e + 4 + s.adam_temp_bytes))


def rank_parts(shape: ModelShape, s: TrainSettings) -> dict[str, int]:
    """Bytes one DeepSpeed rank holds at its peak, by part (docs/gpus.md)."""
    n_all = shape.params()
    n = s.lora_params or n_all  # trained parameters
    w, e = s.world, (2 if s.bf16 else 4)
    part = lambda x: x / w  # noqa: E731  (ZeRO partitions over the data-parallel ranks)
    frozen = (n_all - n) * e  # LoRA's frozen base, never partitioned below stage 3
    weights = (part(n * e) + part(frozen)) if s.stage == 3 else n * e + frozen
    grads = part(n * e) if s.stage >= 2 else n * e  # stage 0, 1: every rank holds the whole gradient
    # Adam's m and v in fp32, and the fp32 master copy: bf16 always has one; in fp32 ZeRO 1-3 clone the partition
    master = 4 if (s.bf16 or s.stage > 0) else 0
    optim = part(n * (8 + master)) if s.stage > 0 else n * (8 + master)  # stage 0 (bf16: FP16_Optimizer) whole
    step = step_bytes(shape, s)
    act = activation_bytes(shape, s)
    gen = kv_cache_bytes(shape, e, s.generate_rows, s.seq_len) if s.generate_rows else 0
    if s.stage == 3:
        buffers = (min(s.stage3_live, n_all) + s.stage3_prefetch) * e
    elif s.stage in (1, 2):  # contiguous_gradients' reduce bucket (a second one with overlap_comm)
        buffers = (2 if s.overlap_comm else 1) * s.bucket * e
    else:
        buffers = 0
    # not at once: backward's activations are freed before the step's fp32 gradients, generation runs alone
    peak = {"activations": act, "optimizer_step": step, "generation": gen}
    top = max(peak, key=peak.get)
    return {"weights": int(weights), "gradients": int(grads), "optimizer": int(optim), top: int(peak[top]),
            "buffers": int(buffers)}


def ref_parts(shape: ModelShape, e: int, rows: int, seq_len: int, completion_len: int, chunk_tokens: int) -> dict:
    """The ref server: its frozen model, and one inference forward's transients (one layer at a time)."""
    tokens = rows * seq_len
    layer = tokens * (3 * e * shape.hidden + e * 3 * shape.intermediate + e * 3 * shape.q_dim)
    return {"weights": shape.params() * e,
            "activations": int(layer + tokens * e * shape.hidden
                               + logits_bytes(shape, e, rows, completion_len, chunk_tokens, grad=False))}


# An HF engine keeps a sampled call's float32 logits (rows x new tokens x vocab) for the behaviour logprobs when they
# fit in this, and needs no logprob forward then (trainer/engines/hf.py imports it: one number for both, issue 62)
KEPT_LOGITS_BYTES = 256 * 2**20


def hf_worker_parts(shape: ModelShape, e: int, rows: int, seq_len: int, group_rows: int = 0, completion_len: int = 0,
                    chunk_tokens: int = 0) -> dict:
    """An HF worker: its weights and one generate call's KV cache (`rows` sequences); where it computes the behaviour
    logprobs (compute_gen_logps: `group_rows` > 0), also the call's kept logits (generate's own, when they fit in
    KEPT_LOGITS_BYTES), else the larger of that cache and the forward that computes them after generate
    (trainer/rollout.py policy_logps: one group, the ref server's inference forward). The first GPU run measured
    the worker at 3.3 GiB where the KV cache alone gave 1.6 (docs/benchmarks.md, the GPU check: the forward's case)."""
    kv = kv_cache_bytes(shape, e, rows, seq_len)
    kept = rows * completion_len * shape.vocab * 4
    if group_rows and kept <= KEPT_LOGITS_BYTES:
        return {"weights": shape.params() * e, "kv_cache": kv, "kept_logits": kept}
    fwd = ref_parts(shape, e, group_rows, seq_len, completion_len, chunk_tokens)["activations"] if group_rows else 0
    return {"weights": shape.params() * e, **({"logprob_forward": fwd} if fwd > kv else {"kv_cache": kv})}


def with_context(parts: dict[str, int], on_gpu: bool, context: int = CUDA_CONTEXT) -> dict[str, int]:
    return dict(parts, cuda_context=context) if on_gpu else dict(parts)


def micro_candidates(rows: int) -> list[int]:
    """Micro-batch sizes to try, largest first: the whole batch, then halving down to 1."""
    out, m = [], rows
    while m >= 1:
        out.append(m)
        m = m // 2 if m > 1 else 0
    return out


def pick(fits, rows: int, micro: int | None, checkpointing: bool | None) -> tuple[int, bool] | None:
    """The micro-batch size and gradient checkpointing a run gets where the user left them unset (None):
    the largest micro-batch that fits without checkpointing (it costs a recompute of every layer), else with
    it; None when nothing fits. `fits(micro, checkpointing)` says whether the ranks fit."""
    gcs = [checkpointing] if checkpointing is not None else [False, True]
    micros = [min(micro, rows) if micro else rows] if micro is not None else micro_candidates(rows)
    for gc in gcs:
        for m in micros:
            if fits(m, gc):
                return m, gc
    return None


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def describe_parts(parts: dict[str, int]) -> str:
    return " + ".join(f"{k} {gib(v)}" for k, v in parts.items() if v) + f" = {gib(sum(parts.values()))} GiB"

