"""Model and tokenizer loading: only through from_pretrained, so any HF path or id works."""
from __future__ import annotations

import logging

import torch

from common.paths import resolve_model_path
from common.settings.model_options import tokenizer_options

log = logging.getLogger(__name__)


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # bf16 where the hardware has it, exact float32 on CPU
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return table[dtype]


def load_tokenizer(path_or_id: str, options: dict | None = None):
    """`options`: the model's loading options (cfg.load_options(), common/settings/model_options.py); the tokenizer
    takes trust_remote_code and revision from them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(path_or_id), **tokenizer_options(options))
    if tok.pad_token_id is None:
        # Qwen base models ship pad == eos or no pad at all; masks come from lengths, so any id works.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation pads on the left
    return tok


def load_model(path_or_id: str, device: str | torch.device = "cpu", dtype: str = "auto", trainable: bool = False,
               options: dict | None = None):
    """`options`: from_pretrained keyword arguments every process passes alike (cfg.load_options():
    trust_remote_code, attn_implementation, revision, model_init_kwargs; common/settings/model_options.py)."""
    from transformers import AutoModelForCausalLM

    dev = device if isinstance(device, torch.device) else pick_device(device)
    td = pick_dtype(dtype, dev)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path_or_id), dtype=td, **(options or {}))
    model.to(dev)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model


def load_model_config(path_or_id: str, options: dict | None = None):
    """The checkpoint's AutoConfig, read with the same trust_remote_code / revision as the model."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(path_or_id), **tokenizer_options(options))


def eos_ids(tokenizer, model=None, chat: bool = True) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos, the generation config's, and (chat=True:
    prompts go through the chat template) the template's turn end, which a base checkpoint's eos
    (<|endoftext|>) is not: without it a base model trained on chat prompts never stops."""
    from common.chat import chat_turn_end_id

    ids = {tokenizer.eos_token_id}
    gc = getattr(model, "generation_config", None)
    if gc is not None and gc.eos_token_id is not None:
        ids.update(gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id])
    turn_end = chat_turn_end_id(tokenizer) if chat else None
    if turn_end is not None and turn_end not in ids:
        log.info("chat template turn end %r (id %d) added to the stop ids", tokenizer.convert_ids_to_tokens(turn_end),
                 turn_end)
        ids.add(turn_end)
    out = sorted(i for i in ids if i is not None)
    log.info("stop ids: %s", out)
    return out
