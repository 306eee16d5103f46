"""The tool demo's cold-start SFT data: worked solutions with and without a `calculator` call, as token ids.

Each trace is tokenised the way a rollout builds it, so SFT teaches exactly the sequences the tool loop
(trainer/tools/multi_turn.py) will produce and read:
  - the assistant's turns are what the chat template renders for them (a call as `<tool_call>{...}</tool_call>`),
    ended by eos, loss on;
  - the tool turn is `tool_suffix_ids` of the real tool message (the calculator's own output, through the
    ToolBox), loss off: the model reads it, never writes it (as the GRPO loss mask does).
"""
from __future__ import annotations

import random

from trainer.data.example import Example
from trainer.demo.tool_task import TOOL, answer_text, own_solution, tool_call_message
from trainer.rollout import encode_prompts
from trainer.tools.multi_turn import tool_suffix_ids


def assistant_turn_ids(tokenizer, message: dict) -> list[int]:
    """The tokens the model samples for an assistant message (tool calls included), eos last: the chat template's
    rendering of [user, message] after the generation prompt, up to the turn's eos."""
    user = [{"role": "user", "content": "x"}]
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [message], tokenize=False, add_generation_prompt=False)
    if not full.startswith(head):
        raise ValueError("the chat template does not render an assistant turn after its generation prompt")
    body = full[len(head):]
    eos = tokenizer.eos_token
    if eos not in body:
        raise ValueError(f"the chat template ends no assistant turn with eos {eos!r}")
    return tokenizer(body[:body.index(eos)], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def tool_trace(tokenizer, toolbox, problem: str) -> tuple[list[int], list[bool]]:
    """call -> the calculator's real answer (as a tool turn) -> <answer>; ids and loss mask."""
    call = tool_call_message(problem)
    ep, = toolbox.start_episodes(1)
    try:
        calls, bad = toolbox.parse(tokenizer.decode(assistant_turn_ids(tokenizer, call), skip_special_tokens=False))
        if bad or len(calls) != 1:
            raise ValueError(f"the ToolBox does not parse the demo's own call for {problem!r}: {bad}")
        (result,), = toolbox.run([(ep, calls)])
    finally:
        toolbox.end_episodes([ep])
    if result.status != "ok":
        raise ValueError(f"the {TOOL} failed on {problem!r}: {result.content}")
    first = assistant_turn_ids(tokenizer, call)
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": TOOL, "content": result.content}])
    last = assistant_turn_ids(tokenizer, {"role": "assistant", "content": answer_text(result.content)})
    return first + suffix + last, [True] * len(first) + [False] * len(suffix) + [True] * len(last)


def own_trace(tokenizer, problem: str) -> tuple[list[int], list[bool]]:
    ids = assistant_turn_ids(tokenizer, {"role": "assistant", "content": own_solution(problem)})
    return ids, [True] * len(ids)


def sft_pairs_for(tokenizer, toolbox, examples: list[Example], p_tool: float, seed: int,
                  system_prompt: str | None) -> list[tuple[list[int], list[int], list[bool]]]:
    """[(prompt ids (listing the tools, as rollouts see them), completion ids, loss mask)]: each example gets the
    tool trace with probability p_tool, else the worked solution by itself."""
    rng = random.Random(seed)
    kept, _ = encode_prompts(tokenizer, examples, system_prompt, 10 ** 9, tools=toolbox.schemas)
    out = []
    for ex, p_ids in kept:
        ids, mask = tool_trace(tokenizer, toolbox, ex.prompt) if rng.random() < p_tool else \
            own_trace(tokenizer, ex.prompt)
        out.append((p_ids, ids, mask))
    return out
