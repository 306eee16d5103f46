"""The built-in per-completion rewards: `fn(completion: str, ground_truth: str) -> float`.

    correct    +1 / -1: the final numeric answer equals the ground truth (GSM8K style)
    format     1.25 / -1: exactly `<think>...</think>` then `<answer>...</answer>`, nothing else
    contains   1 / 0: the ground-truth string occurs in the completion (a toy task for smoke tests)
    math_verify +1 / -1: math-verify's LaTeX equivalence (MATH-style answers); None if the truth won't parse

countdown's reward lives with its arithmetic (countdown.py); the names are registered in registry.py.
"""
from __future__ import annotations

from trainer.rewards.answers import (
    answer_span,
    find_numbers,
    last_boxed,
    need_ground_truth,
    norm_str,
    normalise,
    parse_number,
    rounds_to,
)


def reward_correct(completion: str, ground_truth: str) -> float:
    """+1.0 when the final answer equals the ground truth, else -1.0.

    The answer is read from the last <answer>...</answer> when present (never from elsewhere
    then), else from the whole completion; inside it the last \\boxed{} wins, then the last
    number. Numbers compare exactly as fractions: "12.50" == "12.5", "$1,234" == "1234",
    "-1/2" == "-0.5", "50%" == "50". A ground truth that holds no single number is compared
    as a normalised string (case, whitespace and a trailing period ignored).
    """
    gt = need_ground_truth(ground_truth, "correct").rsplit("####", 1)[-1]  # tolerate a raw GSM8K solution
    gt_norm = normalise(last_boxed(gt) or gt)
    gt_ms = find_numbers(gt_norm)
    span = answer_span(completion)
    if len(gt_ms) != 1:  # not a number: string comparison
        return 1.0 if norm_str(gt) and norm_str(span) == norm_str(gt) else -1.0
    want = parse_number(gt_ms[0])
    ms = find_numbers(normalise(span))
    got = parse_number(ms[-1]) if ms else None
    if want is None or got is None:
        return -1.0
    ok = got.value == want.value or rounds_to(want, got) or rounds_to(got, want)
    return 1.0 if ok else -1.0


# ----------------------------------------------------------------------------- format
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def reward_format(completion: str, ground_truth: str | None = None) -> float:
    """1.25 for exactly `<think>...</think>` then `<answer>...</answer>`, else -1.0 (as simple_GRPO).

    `ground_truth` is unused; it is accepted so the function is a RewardFn like the others.
    Whitespace may surround and separate the two blocks; anything else outside them, a
    repeated or nested tag, or the wrong order scores -1. Empty blocks are allowed.
    Counting tags is linear time, unlike a backtracking regex.
    """
    if any(completion.count(t) != 1 for t in _TAGS):
        return -1.0
    o_t, c_t, o_a, c_a = (completion.index(t) for t in _TAGS)
    if not o_t < c_t < o_a < c_a:
        return -1.0
    outside = completion[:o_t] + completion[c_t + len("</think>"):o_a] + completion[c_a + len("</answer>"):]
    return 1.25 if outside.strip() == "" else -1.0


def reward_total(completion: str, ground_truth: str) -> float:
    """reward_correct + reward_format, as simple_GRPO."""
    return reward_correct(completion, ground_truth) + reward_format(completion)


def reward_contains(completion: str, ground_truth: str) -> float:
    """1.0 if the ground-truth string occurs in the completion, else 0.0 (a toy task for smoke tests)."""
    return 1.0 if need_ground_truth(ground_truth, "contains") in completion else 0.0


def reward_math_verify(completion: str, ground_truth: str) -> float | None:
    """+1 / -1 by Hugging Face's math-verify (LaTeX-aware equivalence); None when the ground truth does not
    parse (not applicable). See trainer/rewards/mathverify.py."""
    from trainer.rewards.mathverify import math_verify_reward  # lazy: sympy is slow to import

    return math_verify_reward(completion, need_ground_truth(ground_truth, "math_verify"))
