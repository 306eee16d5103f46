"""The embedded default model: a tiny random-init Qwen2 with a locally trained BPE tokenizer.

    python -m common.tiny_model OUT_DIR        # build and save an ordinary HF directory

No download: the tokenizer is trained with the `tokenizers` library on text generated here
(the R1 system prompt, arithmetic with <think>/<answer> steps, templated word problems).
Digits are split one per token (as Qwen does), the four reasoning tags and the chat markers
are single tokens, and pad (<|endoftext|>) differs from eos (<|im_end|>).
Everything else loads it through AutoModelForCausalLM / AutoTokenizer.from_pretrained.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from common.settings.argparser import ArgumentParser

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # Qwen2.5's, one id each
# Qwen2.5-style: without tools or tool messages it renders exactly as before (each message in its own im_start/
# im_end block, no default system prompt). With `tools`, a system section lists their JSON schemas; an assistant
# turn's tool_calls are <tool_call>{"name": ..., "arguments": ...}</tool_call> lines; consecutive `tool` messages
# are one user turn of <tool_response> blocks, as Qwen2.5's template renders them.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '"
    "'with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    "'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    "'<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VERSION = "v4"  # bump when the recipe changes, so caches rebuild

_NAMES = ["Natalia", "Weng", "Betty", "James", "Julie", "Mark", "Tina", "Albert", "Ken", "Alexis", "Sam", "Lee"]
_THINGS = ["apples", "clips", "books", "dollars", "pages", "cookies", "marbles", "pencils", "eggs", "tickets"]
_VERBS = ["sold", "bought", "read", "earned", "baked", "found", "gave away", "collected"]


def _corpus(n: int, seed: int) -> list[str]:
    """Text that looks like what the model will see: prompts, reasoning, answers."""
    from common.prompts import SYSTEM_PROMPT  # the prompt it will actually be asked with

    rng = random.Random(seed)
    lines = [SYSTEM_PROMPT] * 20
    for _ in range(n):
        a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(1, 12)
        op = rng.choice("+-*/")
        who, what, verb = rng.choice(_NAMES), rng.choice(_THINGS), rng.choice(_VERBS)
        lines.append(f"{who} {verb} {a} {what} in April and {b} {what} in May. How many {what} did "
                     f"{who} have altogether? What is {a} {op} {b} * {c}?")
        lines.append(f"<think> {b} * {c} = {b * c}, then {a} + {b * c} = {a + b * c}. "
                     f"The answer is {a + b * c}. </think> <answer> {a + b * c} </answer>")
        lines.append(f"#### {a - b} ${a}.{b:02d} {a},{b:03d} {a}/{c} -{b} 3/4 50% \\boxed{{{c}}}")
    return lines + _tool_corpus(n // 10, seed)


# Tools the tokenizer should know the text of: the built-in tools' signatures and docstrings (mirrored from
# trainer/tools/calculator.py and python_tool.py, which common/ does not import) and a user-style one. Without
# them the tools section of a prompt splits almost into characters (the calculator's schema: 310 tokens).
def _calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression to evaluate, using numbers, + - * / // % ** and parentheses,
            for example "123 * 456 + 7".
    """


def _python(code: str) -> str:
    """Run a Python snippet and return what it printed to stdout and stderr.

    Args:
        code: The Python source to run; use print() to show results.
    """


def _add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """


def _tool_corpus(n: int, seed: int) -> list[str]:
    """Rendered tools sections, tool calls and tool responses, as the chat template writes them."""
    from transformers.utils.chat_template_utils import get_json_schema, render_jinja_template

    tools = [get_json_schema(f) for f in (_calculator, _python, _add)]
    for t in tools:
        t["function"]["name"] = t["function"]["name"].lstrip("_")
    rng = random.Random(seed + 1)
    lines = []
    for i in range(n):
        a, b, c = rng.randint(10, 999), rng.randint(10, 99), rng.randint(0, 9)
        expr = f"{a}*{b}+{c}"
        chat = [{"role": "user", "content": expr},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": expr}}}]},
                {"role": "tool", "name": "calculator", "content": str(a * b + c)},
                {"role": "assistant", "content": f"<answer>{a * b + c}</answer>"}]
        (text,), _ = render_jinja_template([chat], tools=tools[:1 + i % 3], chat_template=CHAT_TEMPLATE)
        lines += text.splitlines()
    return lines


def build_tokenizer(vocab_size: int = 1024, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(3000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], padding_side="left",
                                   model_max_length=4096, clean_up_tokenization_spaces=False,
                                   model_input_names=["input_ids", "attention_mask"])  # as Qwen: no token_type_ids
    # Tags are ordinary (non-special) added tokens: one id each, and they survive decode().
    fast.add_tokens(TAG_TOKENS)
    fast.add_tokens(TOOL_TOKENS)  # after the tags: the tags keep their ids
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | os.PathLike, vocab_size: int = 1024, hidden_size: int = 128,
                     num_layers: int = 4, num_heads: int = 4, intermediate_size: int = 512,
                     max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """Build the tokenizer and a random-init Qwen2ForCausalLM and save both to out_dir."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(vocab_size, seed)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id,
        do_sample=True, temperature=0.9, top_p=1.0, top_k=0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("GRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "grpo_trainer")
    return Path(root) / f"tiny-qwen2-{VERSION}"


def ensure_tiny_model(path: str | os.PathLike | None = None) -> Path:
    """Return a directory holding the tiny model, building it once (atomically: several ranks may race)."""
    target = Path(path) if path else default_cache_dir()
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    build_tiny_model(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is identical (fixed seed)
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description="Build the embedded tiny Qwen2 model + tokenizer as an HF directory.")
    p.add_argument("out_dir", help="Directory to write (config.json, model.safetensors, tokenizer files).")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size before added tokens.")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = build_tiny_model(a.out_dir, a.vocab_size, a.hidden_size, a.layers, a.heads, a.intermediate_size, seed=a.seed)
    from transformers import AutoModelForCausalLM
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"tiny Qwen2 model ({n / 1e6:.2f}M parameters) written to {out}")


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
