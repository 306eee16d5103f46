"""generate_batches with tools (trainer/rollout.py): the prompt lists the tools (chat template `tools=`), the
batch's input_ids are the engine's ids turn by turn plus the template's tool turns, loss_mask is False exactly on
tool tokens, engine gen_logps are 0 there, rewards get each completion as TRL's message list, and extra["tools"]
holds the per-completion tool statistics."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_rewards, loaded by dotted path

from common.config import GRPOConfig  # noqa: E402
from tests.test_tool_loop import turns  # noqa: E402
from tests.tool_doubles import FakeToolBox, ScriptEngine  # noqa: E402
from trainer.data.loading import Example  # noqa: E402
from trainer.rewards.scoring import RewardScorer  # noqa: E402
from trainer.rollout import encode_prompts, generate_batches  # noqa: E402
from trainer.tools.multi_turn import tool_suffix_ids  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    """The tiny model's tokenizer, its response template set as a tool run sets it (TRL's parse_response reads it)."""
    from common.tiny_model import build_tokenizer
    from trainer.tools.templates import tool_template
    tok = build_tokenizer()
    tool_template(tok)
    return tok


def cfg(**kw):
    c = GRPOConfig(model="tiny", num_pre_Q=3, max_new_tokens=300, train_zero_spread=True, **kw)
    c.max_tool_calling_iterations = None  # the tool runtime's field (toolrt32); set here until it is merged
    return c


def test_prompts_list_the_tools_and_plain_runs_are_unchanged(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    ex = [Example(prompt=[{"role": "user", "content": "What is 12 * 34?"}], ground_truth="408")]
    (_, with_tools), = encode_prompts(tok, ex, "default", 4096, "auto", fb.schemas)[0]
    (_, plain), = encode_prompts(tok, ex, "default", 4096, "auto")[0]
    assert '"name": "mul"' in tok.decode(with_tools) and "# Tools" in tok.decode(with_tools)
    assert tok.decode(plain) == "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n"


def test_generate_batches_with_tools(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer(["trl_rewards:tool_turns"], timeout=0)
    exs = [Example(prompt=[{"role": "user", "content": "What is 12 * 34?"}], ground_truth="408",
                   columns={"ground_truth": "408"})]
    try:
        batches, stats = generate_batches(engine, tok, exs, cfg(), scorer, toolbox=fb)
    finally:
        scorer.close()
    (b,) = batches
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "408"}])
    comp = first + suffix + final
    P = int(b.prompt_lens[0])
    for i in range(3):
        assert b.input_ids[i, P:P + int(b.completion_lens[i])].tolist() == comp  # exactly what was sampled
    assert b.loss_mask.tolist() == [[True] * len(first) + [False] * len(suffix) + [True] * len(final)] * 3
    tool_at = slice(len(first), len(first) + len(suffix))
    assert torch.all(b.gen_logps[:, tool_at] == 0) and torch.all(b.gen_logps[:, :len(first)] < 0)
    assert b.rewards.tolist() == [2.0] * 3  # one tool message + the last turn says 408: TRL's message list
    assert b.extra["tools"]["calls"] == [1.0] * 3 and b.extra["tools"]["calls/mul"] == [1.0] * 3
    assert stats.tools["turns"] == [2.0] * 3
    # the turns as TRL's parse_response gives them (what the rewards got), on the wire for completions.jsonl
    call, result, answer = b.extra["messages"][0]
    assert "agent_completion" not in b.extra  # an agent run's only (completions.jsonl keeps the text here)
    assert call["content"] == "" and call["reasoning_content"] == "apples"  # no <tool_call> markup, no <think>
    assert call["tool_calls"] == [{"type": "function", "function": {"name": "mul", "arguments": {"a": 12, "b": 34}}}]
    assert result == {"role": "tool", "name": "mul", "content": "408"} and answer["content"] == "<answer> 408 </answer>"
    from common.wire.protocol import decode_rollout, encode_rollout
    from trainer.run.completions import completion_rows
    (row, *_), wired = completion_rows([b], tok, 1), decode_rollout(encode_rollout(b))
    assert row["messages"] == b.extra["messages"][0] and wired.extra["messages"] == b.extra["messages"]


def test_without_a_toolbox_there_is_no_mask_and_no_tool_stats(tok):
    first, final = turns(tok)
    engine = ScriptEngine(tok, [final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer(["trl_rewards:digit_reward"], timeout=0)
    exs = [Example(prompt="What is 12 * 34?", ground_truth="408", columns={"ground_truth": "408"})]
    try:
        (b,), stats = generate_batches(engine, tok, exs, cfg(), scorer)
    finally:
        scorer.close()
    assert b.loss_mask is None and "tools" not in b.extra and stats.tools == {}


def test_an_environment_gets_the_row_at_reset_and_its_observation_extends_the_prompt(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    fb.observe = lambda kw: f" (the board says {kw['ground_truth']})"  # what reset() returns
    first, final = turns(tok)
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer(["trl_rewards:tool_turns", "trl_rewards:prompt_said"], timeout=0)
    prompt = [{"role": "user", "content": "What is 12 * 34?"}]
    exs = [Example(prompt=prompt, ground_truth="408", columns={"ground_truth": "408"})]
    try:
        (b,), _ = generate_batches(engine, tok, exs, cfg(), scorer, toolbox=fb)
    finally:
        scorer.close()
    assert fb.reset_kwargs == [{"prompt": prompt, "ground_truth": "408"}] * 3  # TRL: reset(**row)
    for i in range(3):
        text = tok.decode(b.input_ids[i, :int(b.prompt_lens[i])])
        assert text.endswith("What is 12 * 34? (the board says 408)<|im_end|>\n<|im_start|>assistant\n")
    assert engine.calls[0] == (3, 300)  # one prompt per rollout, n=1
    assert b.extra["logged"]["prompt_said"] == ["What is 12 * 34? (the board says 408)"] * 3  # TRL's rewards' prompts


def test_tool_statistics_are_checked_like_the_other_per_completion_lists():
    from common.wire.batch_extra import ExtraError, check_extra

    check_extra({"tools": {"calls": [1.0, 0.0], "calls/add": [1.0, 0.0]}}, rows=2)
    with pytest.raises(ExtraError, match="tools.calls"):
        check_extra({"tools": {"calls": [1.0]}}, rows=2)
    with pytest.raises(ExtraError, match="tools"):
        check_extra({"tools": [1.0, 2.0]}, rows=2)


def test_evaluate_with_and_without_tools(tok):
    from trainer.evaluate import evaluate

    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    exs = [Example(prompt="What is 12 * 34?", ground_truth="408")] * 3
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    res = evaluate(engine, tok, exs, max_new_tokens=300, progress=False, toolbox=fb, max_tool_calling_iterations=2)
    assert res["tool_calls"] == 3 and res["tool_calls_per_completion"] == 1.0 and res["accuracy"] == 1.0
    assert [m["role"] for m in res["samples"][0]["messages"]] == ["assistant", "tool", "assistant"]
    assert len(engine.calls) == 2 and '"name": "mul"' in tok.decode(engine.last_prompts[0])  # the tools listed
    plain = ScriptEngine(tok, [final], tok.convert_tokens_to_ids("<tool_response>"))
    res = evaluate(plain, tok, exs, max_new_tokens=300, progress=False)  # no toolbox: single turn, no tool fields
    assert "tool_calls" not in res and len(plain.calls) == 1 and res["accuracy"] == 1.0
    assert "# Tools" not in tok.decode(plain.last_prompts[0])


def test_an_environment_reward_is_read_before_the_episode_ends_and_scored(tok):
    """TRL: get_reward() of the rollout's environment is one more reward (named after the class, weight 1),
    read while the episode lives; with reward_fns [] it is the only reward. It reaches the batch's components
    (completions.jsonl's `rewards`, the reward/<name> metric)."""
    from trainer.run.completions import completion_rows
    from trainer.run.step_metrics import batch_metrics

    fb = FakeToolBox({"mul": lambda a, b: a * b})
    fb.reward = lambda ep: float(ep)  # episode k scores k
    first, final = turns(tok)
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer([], timeout=5, env_names=["Env"])
    exs = [Example(prompt="What is 12 * 34?", ground_truth="408")]
    (b,), _ = generate_batches(engine, tok, exs, cfg(), scorer, toolbox=fb, policy_version=4)
    assert fb.rewarded == [(0, True), (1, True), (2, True)] and fb.ended == [0, 1, 2]
    assert b.extra["components"] == {"Env": [0.0, 1.0, 2.0]} and b.rewards.tolist() == [0.0, 1.0, 2.0]
    assert batch_metrics(b)["reward/Env"] == 1.0
    assert all(r["rewards"] == {"Env": float(i)} for i, r in enumerate(completion_rows([b], tok, 1)))


def test_the_observation_goes_to_the_last_message_whatever_its_role():
    """TRL appends reset()'s text to prompt[-1] (an assistant prefill or a system note too), not the last user's."""
    from trainer.rollout import with_observation

    prompt = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "I start:"}]
    got = with_observation(Example(prompt=prompt, ground_truth=None), " board 3x3")
    assert got.prompt == [prompt[0], {"role": "assistant", "content": "I start: board 3x3"}]
    assert prompt[1]["content"] == "I start:"  # the example's own prompt is not changed
    assert with_observation(Example(prompt="Play.", ground_truth=None), " go").prompt == "Play. go"


def test_eval_scores_the_environment_reward(tok):
    """In-training eval (the run's scorer) reads each rollout's get_reward() too, before its episode ends."""
    from trainer.evaluate import evaluate

    fb = FakeToolBox({"mul": lambda a, b: a * b})
    fb.reward = lambda ep: 2.0
    first, final = turns(tok)
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer([], timeout=0, env_names=["Env"])
    res = evaluate(engine, tok, [Example(prompt="What is 12 * 34?", ground_truth="408")] * 2, max_new_tokens=300,
                   progress=False, toolbox=fb, max_tool_calling_iterations=2, scorer=scorer)
    assert res["rewards"] == {"Env": [4.0, 2, 2]} and res["reward_total"] == 4.0
    assert all(live for _, live in fb.rewarded)


def test_rewards_taking_environments_get_each_rollouts_copy_taken_before_its_end(tok):
    """TRL's `environments`: the tool loop copies each rollout's instance after its last turn, before get_reward()
    is read (TRL calls the reward functions first) and before the episode ends; each completion's reward gets its
    own, in training and in eval."""
    from trainer.evaluate import evaluate

    fb = FakeToolBox({"mul": lambda a, b: a * b})
    fb.reward = lambda ep: 0.0
    first, final = turns(tok)
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    scorer = RewardScorer(["trl_rewards:env_value"], timeout=0, env_names=["Env"], environments=True)
    exs = [Example(prompt="What is 12 * 34?", ground_truth="408")]
    (b,), _ = generate_batches(engine, tok, exs, cfg(), scorer, toolbox=fb)
    assert fb.copied == [(0, True, True), (1, True, True), (2, True, True)]
    assert b.extra["components"]["env_value"] == [1.0, 2.0, 3.0] and b.extra["logged"]["env_class"] == ["Counter"] * 3
    engine = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    res = evaluate(engine, tok, exs, max_new_tokens=300, progress=False, toolbox=fb, max_tool_calling_iterations=2,
                   scorer=scorer)
    assert res["rewards"]["env_value"][1] == 1 and fb.copied[0][1:] == (True, True)
