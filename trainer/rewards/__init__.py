"""Rewards: what a completion scores, and how a group is scored.

    answers.py     reading answers: last <answer>, last \\boxed{}, numbers as exact Fractions (the base)
    builtin.py     correct, format, contains, math_verify (mathverify.py: Hugging Face's math-verify)
    countdown.py   countdown's arithmetic without eval(), and its reward
    registry.py    names -> functions: built-ins, @register_reward plugins, dotted paths; score_completion
    timeout.py     each reward call under a hard timeout, in a reward worker process
    scoring.py     RewardScorer: one group, both signatures (ours and TRL's), weights, timeouts

The names users write keep working: `--reward_fns correct,format`, `trainer.rewards:reward_total`,
`from trainer.rewards import register_reward`.
"""
from trainer.rewards.answers import MAX_NUMBER_DIGITS, extract_answer, last_boxed, parse_final_number
from trainer.rewards.builtin import reward_contains, reward_correct, reward_format, reward_math_verify, reward_total
from trainer.rewards.countdown import evaluate_countdown, reward_countdown
from trainer.rewards.registry import (
    REWARD_FNS,
    RewardFn,
    load_reward_fns,
    register_reward,
    reward_name,
    score_completion,
)

__all__ = ["MAX_NUMBER_DIGITS", "REWARD_FNS", "RewardFn", "evaluate_countdown", "extract_answer", "last_boxed",
           "load_reward_fns", "parse_final_number", "register_reward", "reward_contains", "reward_correct",
           "reward_countdown", "reward_format", "reward_math_verify", "reward_name", "reward_total",
           "score_completion"]
