"""Tool runs as TRL 1.16 runs them (issue 60), on the real Qwen vocabulary (tests/qwen_vocab.py) carrying the chat
templates GRPOTrainer swaps in a tool run: two tool turns through the real tool loop (trainer/tools/multi_turn.py, with
a real ToolBox and its inline calculator; a scripted engine) give the token ids TRL's own code gives -- the prompt as
GRPOTrainer._tokenize_prompts renders it, each tool suffix from TRL's _get_tool_suffix_ids (its source, run on a
stand-in trainer: importing grpo_trainer costs ~10 s) -- with chat_template_kwargs in every render; each assistant
turn is TRL's parse_response message (no call markup in its content).

TRL decides the swap on token ids (is_chat_template_prefix_preserving over a dummy exchange): Qwen3's template adds
<think></think> to the last assistant turn only, so TRL swaps it for qwen3_training. gpt-oss's and Llama 3.1/3.2's
render a prefix-preserving text: with their special tokens as single tokens (as their own tokenizers have them) TRL
keeps them; without (this vocabulary as it is) BPE merges across `<|call|><|start|>` break the prefix, TRL swaps
gpt-oss's for gptoss_training -- which breaks it the same way, so TRL fails at the first tool call and we refuse at
start -- and has no training template for Llama 3.1/3.2: refused at start, in one line, as TRL refuses them."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.trl_import import trl_module
from trainer.data.example import Example
from trainer.engines.base import GenEngine, Sample, budgets
from trainer.rollout import encode_prompts
from trainer.tools import ToolBox
from trainer.tools.calculator import calculator
from trainer.tools.multi_turn import tool_rollouts
from trainer.tools.schemas import load_tools

USER = [{"role": "user", "content": "What is (2+3)*4?"}]
# per template: the render arguments (chat_template_kwargs), and the model's three turns as it writes them
SCRIPTS = {
    "qwen3": ({"enable_thinking": False}, [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*4"}}\n</tool_call><|im_end|>',
        "The answer is 20.<|im_end|>"]),
    "gptoss": ({"reasoning_effort": "low"}, [
        ' to=functions.calculator<|channel|>commentary json<|message|>{"expression": "2+3"}<|call|>',
        ' to=functions.calculator<|channel|>commentary json<|message|>{"expression": "5*4"}<|call|>',
        "<|channel|>final<|message|>The answer is 20.<|return|>"]),
}


GPTOSS_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def qwen_tok(qwen_instruct_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen_instruct_dir)


@pytest.fixture(scope="module")
def gptoss_tok(qwen_instruct_dir):
    """The vocabulary with gpt-oss's special tokens added, as gpt-oss's own tokenizer has them (single tokens)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_instruct_dir)
    tok.add_tokens(GPTOSS_SPECIALS, special_tokens=True)
    return tok


def carrying(tok, name: str):
    tok.chat_template = getattr(trl_module("chat_template_utils"), f"{name}_chat_template")
    tok.response_template = None  # as loaded: the ToolBox sets it (TRL's add_response_schema)
    return tok


def trl_tool_suffix_ids():
    """GRPOTrainer._get_tool_suffix_ids as TRL 1.16 ships it: its source, compiled alone."""
    import trl
    src = (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text(encoding="utf-8")
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "_get_tool_suffix_ids")
    ns = {"prepare_multimodal_messages": trl_module("data_utils").prepare_multimodal_messages}
    exec(compile(ast.Module([fn], []), "trl/trainer/grpo_trainer.py", "exec"), ns)  # noqa: S102 - TRL's own code
    return ns["_get_tool_suffix_ids"]


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


class Scripted(GenEngine):
    """Turn k of a rollout is turns[k], k = how many of the turns its context holds; a turn ends where it ends (an
    engine stopping at the template's end of turn), cut (truncated) at the budget."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.eos_ids, self.calls = turns, [], []

    def generate(self, prompt_ids, n, *, max_new_tokens, greedy=False):
        self.calls.append(len(prompt_ids))
        out = []
        for p, limit in zip(prompt_ids, budgets(max_new_tokens, len(prompt_ids))):
            turn = self.turns[sum(contains(list(p), t) for t in self.turns)]
            out += [Sample(list(p), torch.tensor(turn[:limit]), None, len(turn) > limit) for _ in range(n)]
        return out


@pytest.mark.parametrize("name, swapped", [("qwen3", "qwen3_training"), ("gptoss", None)])
def test_two_tool_turns_give_trls_token_ids_and_messages(request, name, swapped):
    tok = carrying(request.getfixturevalue("gptoss_tok" if name == "gptoss" else "qwen_tok"), name)
    kw, texts = SCRIPTS[name]
    ctu = trl_module("chat_template_utils")
    box = ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="m", chat_template_kwargs=kw)
    # what GRPOTrainer.__init__ sets as self.chat_template in a tool run
    training = None if ctu.is_chat_template_prefix_preserving(tok) else ctu.get_training_chat_template(tok)
    assert box.template.training_template == swapped and box.template.chat_template == training
    assert box.family == name
    turns = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    (_, prompt), = encode_prompts(tok, [Example(USER, "20")], None, 10 ** 6, "messages", box.schemas,
                                  template_kwargs=box.template_kwargs)[0]
    eng = Scripted(turns)
    (s,), (msgs,), (stats,) = tool_rollouts(eng, tok, box, [prompt], 1, max_new_tokens=4096, max_iterations=None)

    # TRL's own rendering: _tokenize_prompts, then prompt + turn + _get_tool_suffix_ids(tool message) per turn
    trl_prompt = tok.apply_chat_template(conversation=[USER], tools=[calculator], chat_template=training,
                                         add_generation_prompt=True, tokenize=True, return_dict=True, **kw)
    assert prompt == trl_prompt["input_ids"][0]
    trainer = SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template=training, chat_template_kwargs=kw,
                              _is_vlm=False)
    suffix = [trl_tool_suffix_ids()(trainer, [{"role": "tool", "name": "calculator", "content": v}])
              for v in ("5", "20")]
    assert s.completion_ids.tolist() == turns[0] + suffix[0] + turns[1] + suffix[1] + turns[2]
    assert s.loss_mask.tolist() == [True] * len(turns[0]) + [False] * len(suffix[0]) + [True] * len(turns[1]) \
        + [False] * len(suffix[1]) + [True] * len(turns[2])
    assert not s.truncated and stats["calls"] == 2 and eng.calls == [1, 1, 1]

    # each assistant turn as TRL's parse_response gives it: the calls in tool_calls, none of their markup in content
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in msgs if m["role"] == "tool"] == ["5", "20"]
    said = [m for m in msgs if m["role"] == "assistant"]
    assert [c["function"] for m in said[:2] for c in m["tool_calls"]] == [
        {"name": "calculator", "arguments": {"expression": e}} for e in ("2+3", "5*4")]
    assert [m["content"] for m in said] == ["", "", "The answer is 20."] and "tool_calls" not in said[2]
    context = prompt + turns[0] + suffix[0]
    assert said[1] == ctu.parse_response(tok, turns[1], prefix=context, tools=box.schemas)


def test_gptoss_without_its_special_tokens_is_swapped_then_refused_at_start(qwen_tok):
    """TRL swaps in gptoss_training, whose tool suffix breaks the prefix on these ids just the same: TRL's
    _get_tool_suffix_ids raises at the first tool call; the ToolBox refuses the run when it starts, in one line."""
    tok = carrying(qwen_tok, "gptoss")
    ctu = trl_module("chat_template_utils")
    assert not ctu.is_chat_template_prefix_preserving(tok)
    trainer = SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template=ctu.get_training_chat_template(tok),
                              chat_template_kwargs={}, _is_vlm=False)
    with pytest.raises(ValueError, match="Unexpected tokenization"):
        trl_tool_suffix_ids()(trainer, [{"role": "tool", "name": "calculator", "content": "5"}])
    with pytest.raises(ValueError, match="model m: TRL's training chat template gptoss_training does not keep") as e:
        ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="m")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["llama3_1", "llama3_2"])
def test_llama_3_1_and_3_2_tool_runs_are_refused_at_start(qwen_tok, name):
    """Not prefix-preserving on these ids and TRL has no training template for them: GRPOTrainer.__init__ raises
    (get_training_chat_template); the ToolBox, built when a worker or rank starts, refuses the run in one line."""
    tok = carrying(qwen_tok, name)
    with pytest.raises(ValueError, match=r"model m: its chat template \(llama3\) .* no training chat template") as e:
        ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="m")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not training-compatible"):  # TRL's own refusal of the same template
        trl_module("chat_template_utils").get_training_chat_template(tok)
