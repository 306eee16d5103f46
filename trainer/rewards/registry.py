"""Reward functions by name: the built-ins, plugins registered with @register_reward, and your own by module or
file ("my_rewards:score", "my_pkg.my_rewards.score", "path/to/my_rewards.py:score"; common/user_code.py finds them
in the folder launch.sh ran in, in every process). Rewards see the decoded completion text with
special tokens already stripped by the caller; score_completion sums them per completion.

TRL-style batch functions `f(prompts, completions, **columns) -> list[float | None]` load the same way
(scoring.py tells the kinds apart and calls them).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable

from common.user_code import load_object
from trainer.rewards.builtin import reward_contains, reward_correct, reward_format, reward_math_verify, reward_total
from trainer.rewards.countdown import reward_countdown

RewardFn = Callable[[str, str], float]

REWARD_FNS: dict[str, RewardFn] = {
    "correct": reward_correct,
    "format": reward_format,
    "countdown": reward_countdown,
    "contains": reward_contains,
    "math_verify": reward_math_verify,
}


# Built-ins that compare against the ground truth: prompt-only data (no answer column) is refused for them.
NEEDS_GROUND_TRUTH = (reward_correct, reward_contains, reward_countdown, reward_math_verify, reward_total)


def needs_ground_truth(fn: RewardFn) -> bool:
    return any(fn is f for f in NEEDS_GROUND_TRUTH)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` loadable by a short name (plugins call it at import time)."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARD_FNS and REWARD_FNS[name] is not fn:
            raise ValueError(f"reward name {name!r} is already registered")
        REWARD_FNS[name] = fn
        return fn
    return deco


def _import_fn(spec: str) -> RewardFn:
    if ":" not in spec and "." not in spec:
        raise ValueError(f"unknown reward function {spec!r}: use a built-in name ({', '.join(REWARD_FNS)}), "
                         f"a module path 'my_rewards:function' or a file 'path/to/my_rewards.py:function'")
    try:
        return load_object(spec)
    except ValueError as e:
        raise ValueError(f"reward function {e}") from e


def load_reward_fns(spec: str | list[str]) -> list[RewardFn]:
    """Built-in names and/or dotted paths -> functions. A string may list several, comma-separated. An empty list
    is no function (valid where an environment's get_reward() gives the reward: GRPOConfig.reward_specs)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if not all(isinstance(s, str) and s.strip() for s in items):
        raise ValueError(f"reward_fns must be a list of names or dotted paths, got {spec!r}")
    names = [s.strip() for s in items]
    return [REWARD_FNS[n] if n in REWARD_FNS else _import_fn(n) for n in names]


def reward_name(fn: RewardFn) -> str:
    """Short name for logs: the registry name of a built-in, else the function's own name."""
    for name, f in REWARD_FNS.items():
        if f is fn:
            return name
    return getattr(fn, "__name__", type(fn).__name__)


def score_completion(completion: str, ground_truth: str, fns: list[RewardFn]) -> tuple[float, dict[str, float]]:
    """(sum of rewards, {name: reward}); a repeated name gets a #2, #3... suffix."""
    parts: dict[str, float] = {}
    for fn in fns:
        name = base = reward_name(fn)
        k = 2
        while name in parts:
            name, k = f"{base}#{k}", k + 1
        r = float(fn(completion, ground_truth))
        if not math.isfinite(r):  # a NaN reward would poison the whole group's advantages
            raise ValueError(f"reward function {name!r} returned {r!r}")
        parts[name] = r
    return sum(parts.values()), parts


OURS_SIG = "fn(completion: str, ground_truth: str) -> float"
TRL_SIG = "fn(prompts, completions, **columns) -> list[float | None]"


def reward_kind(fn, name: str) -> str:
    """'ours' or 'trl' from the signature; anything else is an error naming both signatures."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward function {name!r}: cannot read its signature ({e})") from e
    params = sig.parameters
    if "completions" in params:
        return "trl"
    try:
        sig.bind("completion", "ground truth")
        return "ours"
    except TypeError:
        pass
    if all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params.values()) and params:
        return "trl"  # keyword-only / **kwargs: TRL calls by keyword
    raise ValueError(f"reward function {name!r} has signature {sig}, which fits neither {OURS_SIG} (ours) "
                     f"nor {TRL_SIG} (TRL-style)")
