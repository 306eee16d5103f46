"""TRL-style reward functions as people write them for TRL's GRPOTrainer, used unchanged here.

    --reward_fns examples.byo.my_rewards:accuracy,examples.byo.my_rewards:format_reward
"""
import re


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion  # messages runs


def accuracy(prompts, completions, ground_truth, **kwargs):
    """1.0 when the last <answer>...</answer> equals the ground_truth column; None when there is no answer tag."""
    out = []
    for c, gt in zip(completions, ground_truth):
        found = re.findall(r"<answer>(.*?)</answer>", _text(c), flags=re.S)
        out.append(None if not found else float(found[-1].strip() == str(gt).strip()))
    return out


def format_reward(completions, **kwargs):
    """1.0 for completions that hold an <answer>...</answer> block."""
    return [1.0 if re.search(r"<answer>.*?</answer>", _text(c), flags=re.S) else 0.0 for c in completions]


def digits(completions, **kwargs):
    """Share of digits in the completion: a shaped reward even a random tiny model moves (so every group has a
    reward spread in the CPU smoke runs of docs/data.md; real runs drop it)."""
    out = []
    for c in completions:
        chars = [ch for ch in _text(c) if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out
