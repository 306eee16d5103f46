"""TRL-style reward functions, written exactly as for TRL's GRPOTrainer (used by the reward and e2e tests).

Loaded by dotted path ("trl_rewards:digit_reward") with tests/ on PYTHONPATH.
"""
import time


def digit_reward(prompts, completions, **kwargs):
    """Share of digits in each completion (strings, or [{"role": "assistant", "content": ...}] lists)."""
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else c
        chars = [ch for ch in text if not ch.isspace()]
        out.append(sum("0" <= ch <= "9" for ch in chars) / len(chars) if chars else 0.0)
    return out


def exact_answer(prompts, completions, ground_truth, **kwargs):
    """1.0 when the completion equals the row's ground_truth column; None for rows marked 'skip'."""
    return [None if gt == "skip" else float(c.strip() == gt) for c, gt in zip(completions, ground_truth)]


def hang_on_marker(prompts, completions, ground_truth, **kwargs):
    """Hangs forever for a group whose ground truth is 'hang' (a reward that must not freeze the run)."""
    if any(gt == "hang" for gt in ground_truth):
        while True:
            time.sleep(1)
    return [0.0] * len(completions)


def hang_on_answer(completion, ground_truth):
    """Ours-style: hangs forever on the completion 'HANG', else 1.0 when it equals the ground truth."""
    if completion == "HANG":
        while True:
            time.sleep(1)
    return 1.0 if completion == ground_truth else 0.0


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def raises(prompts, completions, **kwargs):
    raise KeyError("boom")


def neither(a, b, c):
    return 0.0


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: prefer completions of 20 characters (prompt-only data, no ground truth)."""
    return [-abs(20 - len(c)) for c in completions]


def row_id(prompts, completions, id, **kwargs):
    """The row's `id` column as the reward (a prompt-only row's other columns reach TRL-style rewards)."""
    return [float(i) for i in id]


def no_truth(completion, ground_truth):
    """Ours-style: 1.0 when the ground truth arrived as None (a prompt-only row), else 0.0."""
    return 1.0 if ground_truth is None else 0.0


def tool_turns(prompts, completions, **kwargs):
    """A multi-turn completion as TRL gives it: the number of tool messages, plus 1 when the last assistant turn
    says 408 (tool-loop tests)."""
    out = []
    for c in completions:
        tools = [m for m in c if m["role"] == "tool"]
        out.append(len(tools) + float(c[-1]["role"] == "assistant" and "408" in c[-1]["content"]))
    return out


async def async_len(prompts, completions, **kwargs):
    """An `async def` reward (TRL awaits it on an event loop): the completion's length in characters."""
    import asyncio
    await asyncio.sleep(0)
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


_QUEUE = None  # made at the first call, bound to its event loop (as a judge's AsyncOpenAI client is)


async def _through_queue(value):
    import asyncio
    global _QUEUE
    _QUEUE = _QUEUE or asyncio.Queue()
    asyncio.get_running_loop().call_later(0.001, _QUEUE.put_nowait, value)
    return await _QUEUE.get()  # waits: binds the queue to the running loop; another loop cannot use it


async def queued_len(prompts, completions, **kwargs):
    """An async TRL-style reward keeping a loop-bound object across calls: each completion's length."""
    return [float(await _through_queue(len(c))) for c in completions]


async def queued_ours(completion, ground_truth):
    """The same in our signature, one completion a call."""
    return float(await _through_queue(len(completion)))


def curriculum(prompts, completions, trainer_state, **kwargs):
    """TRL's curriculum pattern: reads trainer_state.global_step (and max_steps, epoch); logs as TRL rewards do."""
    kwargs["log_extra"]("state", [f"{trainer_state.global_step}/{trainer_state.max_steps}"] * len(completions))
    kwargs["log_metric"]("curriculum_step", float(trainer_state.global_step))
    return [float(trainer_state.global_step) + trainer_state.epoch * 0.0] * len(completions)


def none_on_marker(prompts, completions, **kwargs):
    """None (not applicable) for a completion that contains 'NONE', else 1.0 when it contains 'YES'."""
    return [None if "NONE" in c else float("YES" in c) for c in completions]


_STARTED: set = set()


async def _meet(me: str, other: str, n: int) -> list:
    """1.0 when the other reward ran at the same time (gathered on one event loop), 0.0 when it never started."""
    import asyncio
    _STARTED.add(me)
    for _ in range(100):
        if other in _STARTED:
            break
        await asyncio.sleep(0.01)
    seen = other in _STARTED
    await asyncio.sleep(0.05)  # let the other see us too
    _STARTED.discard(me)
    return [float(seen)] * n


async def meet_a(prompts, completions, **kwargs):
    return await _meet("a", "b", len(completions))


async def meet_b(prompts, completions, **kwargs):
    return await _meet("b", "a", len(completions))


async def async_raises(prompts, completions, **kwargs):
    raise KeyError("async boom")


def env_value(completions, environments, **kwargs):
    """TRL's `environments`: each completion's episode instance, read as the episode left it."""
    log_extra = kwargs["log_extra"]
    log_extra("env_class", [type(e).__name__ for e in environments])
    return [float(e.value) for e in environments]


def env_seen(completions, **kwargs):
    """Takes **kwargs: TRL passes it `environments` too (when the run has them); -1 without."""
    envs = kwargs.get("environments")
    return [-1.0] * len(completions) if envs is None else [float(e.value > 0) for e in envs]


def prompt_said(prompts, completions, **kwargs):
    """Logs the last prompt message each completion's reward got (TRL: reset()'s text appended)."""
    kwargs["log_extra"]("prompt_said", [p[-1]["content"] for p in prompts])
    return [0.0] * len(completions)


def env_state_ok(completions, environments, **kwargs):
    """Each copy's state checked by its own class (tests/env_state_user.py `_check`)."""
    return [float(e._check()) for e in environments]


def env_bump(completions, environments, **kwargs):
    """Changes its copies: neither the other functions nor the executor's instances see it."""
    for e in environments:
        e.value += 100
    return [float(e.value) for e in environments]


def slow_batch(prompts, completions, **kwargs):
    """1.3 s a call, whatever its size (reward_timeout tests)."""
    import time
    time.sleep(1.3)
    return [1.0] * len(completions)


def said_turns(prompts, completions, **kwargs):
    """Conversational signature (agent runs): prompts are message lists, completions the messages after them; the
    reward is the number of assistant turns plus 10 times the user turns the conversation added."""
    assert all(isinstance(p, list) and isinstance(c, list) for p, c in zip(prompts, completions)), prompts
    return [sum(m["role"] == "assistant" for m in c) + 10.0 * sum(m["role"] == "user" for m in c) for c in completions]
