"""The multi-turn tool loop (trainer/tools/multi_turn.py) over a scripted engine: token exactness across turns (ids
never re-tokenised), the tool turn as the chat template renders it, loss_mask / logprobs alignment, the token
budget and the iteration limit, and a malformed / unknown / raising call as a counted tool message."""
from __future__ import annotations

import pytest
import torch

from tests.tool_doubles import FakeToolBox, ScriptEngine, spelled
from trainer.tools.multi_turn import messages_extra, stats_extra, tool_rollouts, tool_suffix_ids


@pytest.fixture(scope="module")
def tok():
    """The tiny model's tokenizer, its response template set as a tool run sets it (TRL's parse_response reads it)."""
    from common.tiny_model import build_tokenizer
    from trainer.tools.templates import tool_template
    tok = build_tokenizer()
    assert tool_template(tok).training_template is None  # its template keeps the prefix: no swap
    return tok


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 12, "b": 34}}\n</tool_call>'


def turns(tok):
    first = spelled(tok, "<think> apples ") + enc(tok, " </think>\n" + CALL) + [tok.eos_token_id]
    final = spelled(tok, "<answer> 408 </answer>") + [tok.eos_token_id]
    return first, final


def prompt(tok, fb):
    msgs = [{"role": "user", "content": "What is 12 * 34?"}]
    return enc(tok, tok.apply_chat_template(msgs, tools=fb.schemas, tokenize=False, add_generation_prompt=True))


def run(tok, fb, script, n=2, max_new_tokens=200, max_iterations=None, logprobs=True):
    eng = ScriptEngine(tok, script, tok.convert_tokens_to_ids("<tool_response>"), logprobs=logprobs)
    out = tool_rollouts(eng, tok, fb, [prompt(tok, fb)], n, max_new_tokens=max_new_tokens,
                        max_iterations=max_iterations)
    return eng, out


def test_ids_are_the_engine_turns_plus_the_template_tool_suffix_never_retokenised(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    # the premise: these ids do not survive decode + encode, so a loop that re-tokenised would change them
    assert enc(tok, tok.decode(first)) != first and enc(tok, tok.decode(final)) != final
    eng, (samples, messages, stats) = run(tok, fb, [first, final])
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "408"}])
    assert tok.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    for s in samples:
        assert s.completion_ids.tolist() == first + suffix + final
        assert s.loss_mask.tolist() == [True] * len(first) + [False] * len(suffix) + [True] * len(final)
        lp = lambda k: [-(i + 1) / 100 for i in range(k)]  # noqa: E731 - the engine's logprob of token i of a turn
        assert s.logprobs.tolist() == pytest.approx(lp(len(first)) + [0.0] * len(suffix) + lp(len(final)))
        assert not s.truncated
    # turn 2 was generated from exactly prompt + turn 1 + suffix: one batched call for both rollouts, n=1
    assert eng.calls == [(1, 200), (2, [200 - len(first) - len(suffix)] * 2)]
    assert fb.started == [0, 1] and fb.ended == [0, 1]  # one episode per rollout, ended
    assert messages[0][0]["tool_calls"] == [{"type": "function", "function": {"name": "mul",
                                                                              "arguments": {"a": 12, "b": 34}}}]
    assert "<tool_call>" not in messages[0][0]["content"]  # TRL's parse_response: the call is in tool_calls only
    assert messages[0][1] == {"role": "tool", "name": "mul", "content": "408"}
    assert messages[0][2] == {"role": "assistant", "content": "<answer> 408 </answer>"}
    assert stats[0]["calls"] == 1 and stats[0]["turns"] == 2 and stats[0]["calls/mul"] == 1
    assert stats[0]["seconds"] == 0.5
    ex = stats_extra(stats)
    assert ex["calls"] == [1.0, 1.0] and ex["calls/mul"] == [1.0, 1.0] and ex["turns"] == [2.0, 2.0]


def test_the_suffix_is_what_the_template_renders_for_the_whole_conversation(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    (s,), (msgs,), _ = run(tok, fb, [first, final], n=1)[1]
    # each assistant turn as the model wrote it (its calls included), rendered as such; the tool turns as the loop
    said = [tok.decode(t[:-1]) for t in (first, final)]
    conv = [{"role": "user", "content": "What is 12 * 34?"}] + [
        {"role": "assistant", "content": said.pop(0)} if m["role"] == "assistant" else m for m in msgs]
    text = tok.apply_chat_template(conv, tools=fb.schemas, tokenize=False)
    assert tok.decode(prompt(tok, fb) + s.completion_ids.tolist()) == text.rstrip("\n")


def test_a_tool_turn_that_does_not_fit_is_rolled_back_as_trl_does(tok):
    """TRL's _tool_call_loop: a tool result past max_completion_length (`>`) is rolled back, the rollout keeps the
    turn that made the call, as it is: not truncated (it ends with the model's eos), so mask_truncated_completions
    keeps it; its tool messages are dropped. One that fills the budget exactly is kept, and the rollout ends
    truncated (the next turn has no token)."""
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "408"}])
    eng, (samples, msgs, stats) = run(tok, fb, [first, final], max_new_tokens=len(first) + len(suffix) - 1)
    for s, m in zip(samples, msgs):  # one token short: the tool turn rolls back, the model's turn stays
        assert s.completion_ids.tolist() == first and not s.truncated and s.loss_mask.all()
        assert [x["role"] for x in m] == ["assistant"] and m[0]["tool_calls"][0]["function"]["name"] == "mul"
    assert len(eng.calls) == 1 and stats[0]["calls"] == 1  # the tool ran (its result's size decided)
    eng, (samples, msgs, _) = run(tok, fb, [first, final], max_new_tokens=len(first) + len(suffix))
    for s, m in zip(samples, msgs):  # exactly the budget: kept, and nothing after it (TRL's boundary is `>`)
        assert s.completion_ids.tolist() == first + suffix and s.truncated
        assert s.loss_mask.tolist() == [True] * len(first) + [False] * len(suffix)
        assert [x["role"] for x in m] == ["assistant", "tool"]
    assert len(eng.calls) == 1
    # room for part of the last turn: cut there, truncated, never more than max_new_tokens in all
    budget = len(first) + len(suffix) + 3
    eng, (samples, _, _) = run(tok, fb, [first, final], max_new_tokens=budget)
    assert eng.calls[-1][1] == [3, 3]
    assert all(len(s.completion_ids) == budget and s.truncated for s in samples)
    assert samples[0].completion_ids.tolist()[-3:] == final[:3]


def test_each_rollout_generates_its_next_turn_within_its_own_remaining_tokens(tok):
    """Issue 42: a tool round's call gives each rollout its own budget (before: the longest remaining one for all,
    so a rollout with a longer first turn generated past its end and was cut)."""
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    longer = spelled(tok, "<think> apples and pears ") + first[len(spelled(tok, "<think> apples ")):]

    class TwoLengths(ScriptEngine):
        def turn(self, prompt, index):
            return (longer if index % 2 else first) if len(self.calls) == 1 else super().turn(prompt, index)

    eng = TwoLengths(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "408"}])
    samples, _, _ = tool_rollouts(eng, tok, fb, [prompt(tok, fb)], 2, max_new_tokens=200, max_iterations=None)
    assert len(longer) > len(first)
    assert eng.calls[1] == (2, [200 - len(first) - len(suffix), 200 - len(longer) - len(suffix)])
    assert [s.completion_ids.tolist() for s in samples] == [first + suffix + final, longer + suffix + final]


def test_iteration_limit_and_no_limit(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, _ = turns(tok)  # the model always calls
    eng, (samples, msgs, stats) = run(tok, fb, [first], n=1, max_new_tokens=1000, max_iterations=2)
    assert stats[0]["calls"] == 2 and stats[0]["turns"] == 3 and len(eng.calls) == 3
    assert not samples[0].truncated and samples[0].completion_ids.tolist()[-len(first):] == first
    assert [m["role"] for m in msgs[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    eng, (samples, _, stats) = run(tok, fb, [first], n=1, max_iterations=0)
    assert stats[0]["calls"] == 0 and len(eng.calls) == 1
    eng, (samples, _, stats) = run(tok, fb, [first], n=1, max_new_tokens=300, max_iterations=None)
    # no limit: it calls until a tool turn no longer fits, which rolls back (TRL): it ends with its own turn
    assert len(samples[0].completion_ids) <= 300 and stats[0]["calls"] >= 3
    assert not samples[0].truncated and samples[0].completion_ids.tolist()[-len(first):] == first


def test_malformed_unknown_and_raising_calls_are_tool_messages_counted(tok):
    def boom(x):
        raise RuntimeError("kaputt")

    fb = FakeToolBox({"boom": boom})
    bad = enc(tok, '<tool_call>\n{"name": oops}\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n'
                   '</tool_call>\n<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>') \
        + [tok.eos_token_id]
    _, final = turns(tok)
    _, (samples, msgs, stats) = run(tok, fb, [bad, final], n=1, max_new_tokens=1000)
    st = stats[0]
    assert st["calls"] == 2 and st["malformed"] == 1 and st["failed"] == 2 and st["timed_out"] == 0
    tools = [m for m in msgs[0] if m["role"] == "tool"]
    assert [t["content"] for t in tools][:2] == ["unknown tool nope", "error: kaputt"]
    assert tools[2]["content"].startswith("malformed tool call")
    assert st["calls/boom"] == 1 and "calls/nope" not in st  # per tool: configured tools only
    assert samples[0].completion_ids.tolist()[-len(final):] == final  # the rollout went on


def test_an_engine_without_logprobs_gives_none(tok):
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    _, (samples, _, _) = run(tok, fb, list(turns(tok)), logprobs=False)
    assert all(s.logprobs is None for s in samples)
    assert samples[0].loss_mask.dtype == torch.bool


def test_tool_metrics_keys_per_completion():
    from common.wire.protocol import ScoredBatch
    from trainer.run.step_metrics import batch_metrics
    from trainer.tools.multi_turn import add_tool_totals, tool_metric_keys

    tools = stats_extra([{"calls": 2, "turns": 3, "failed": 1, "timed_out": 0, "malformed": 1, "seconds": 0.5,
                          "calls/calculator": 2},
                         {"calls": 0, "turns": 1, "failed": 0, "timed_out": 1, "malformed": 0, "seconds": 0.0}])
    b = ScoredBatch(input_ids=torch.ones(2, 4, dtype=torch.long), prompt_lens=torch.tensor([2, 2]),
                    completion_lens=torch.tensor([2, 2]), advantages=torch.zeros(2), extra={"tools": tools})
    m = batch_metrics(b)
    assert m["tools/calls_per_completion"] == 1.0 and m["tools/turns_per_completion"] == 2.0
    assert m["tools/failed"] == 0.5 and m["tools/timed_out"] == 0.5 and m["tools/malformed"] == 0.5
    assert m["tools/seconds"] == 0.25 and m["tools/calculator/calls"] == 1.0
    assert set(tool_metric_keys(["calculator"])) == {k for k in m if k.startswith("tools/")}
    totals: dict = {}
    add_tool_totals(totals, tools)
    assert totals == {"completions": 2, "tool_calls": 2, "tool_failed": 1, "tool_timed_out": 1, "tool_malformed": 1}


def _synced_rank(rank: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from common.tiny_model import build_tokenizer
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    tok = build_tokenizer()
    fb = FakeToolBox({"mul": lambda a, b: a * b})
    first, final = turns(tok)
    # rank 0's model calls a tool in every turn (two tool rounds, then the iteration limit); rank 1's never does
    script = [first] if rank == 0 else [final]
    eng = ScriptEngine(tok, script, tok.convert_tokens_to_ids("<tool_response>"))
    eng.synced_gpus = True  # ZeRO-3: every generate call is a collective (the HF engine's dummy call past ours)
    samples, _, stats = tool_rollouts(eng, tok, fb, [prompt(tok, fb)], 2, max_new_tokens=1000, max_iterations=2)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"calls": eng.calls, "tool_calls": [s["calls"] for s in stats]}, f)
    dist.destroy_process_group()


def test_zero3_ranks_make_the_same_number_of_generate_calls(tmp_path):
    import json

    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'init'}"
    mp.start_processes(_synced_rank, args=(init, str(tmp_path / "out")), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["tool_calls"] == [2, 2] and r1["tool_calls"] == [0, 0]
    assert len(r0["calls"]) == len(r1["calls"]) == 3  # rank 1 joins rank 0's two tool rounds with no prompts
    assert [n for n, _ in r1["calls"]] == [1, 0, 0] and [n for n, _ in r0["calls"]] == [1, 2, 2]


def test_with_the_real_toolbox_and_its_calculator(tok):
    from common.config import GRPOConfig
    from trainer.tools import ToolBox

    box = ToolBox.from_config(GRPOConfig(model="tiny", tools=["calculator"]), tok)
    try:
        call = enc(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>')
        broken = enc(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 *"}}\n</tool_call>')
        _, final = turns(tok)
        for first, content, status in ((call, "408", "ok"), (broken, "Error", "error")):
            first = first + [tok.eos_token_id]
            eng = ScriptEngine(tok, [first, final], tok.convert_tokens_to_ids("<tool_response>"))
            p = enc(tok, tok.apply_chat_template([{"role": "user", "content": "12*34?"}], tools=box.schemas,
                                                 tokenize=False, add_generation_prompt=True))
            (s,), (msgs,), (st,) = tool_rollouts(eng, tok, box, [p], 1, max_new_tokens=300, max_iterations=None)
            assert msgs[1]["role"] == "tool" and msgs[1]["content"].startswith(content), msgs
            suffix = tool_suffix_ids(tok, [msgs[1]])
            assert s.completion_ids.tolist() == first + suffix + final
            assert st["calls/calculator"] == 1 and st["failed"] == (status == "error")
    finally:
        box.close()


def test_a_groups_messages_ride_the_wire_only_where_they_fit(caplog):
    small = [[{"role": "assistant", "content": "hi"}]] * 8
    assert messages_extra(small) is small
    big = [[{"role": "tool", "name": "t", "content": "x" * 5000}]] * 8  # ~40 KiB: past the 32 KiB kept for them
    assert messages_extra(big) is None and messages_extra(big) is None
    assert len([r for r in caplog.records if "completions.jsonl shows" in r.message]) <= 1  # said once a process
