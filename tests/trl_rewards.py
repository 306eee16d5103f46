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
