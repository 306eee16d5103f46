"""Reward functions: `fn(completion: str, ground_truth: str) -> float`, summed per completion.

Built-ins (names usable in `--reward_fns`):
    correct    +1 / -1: the final numeric answer equals the ground truth (GSM8K style)
    format     1.25 / -1: exactly `<think>...</think>` then `<answer>...</answer>`, nothing else
    countdown  +1 / -1: the `<answer>` expression hits the target using each given number once
    contains   1 / 0: the ground-truth string occurs in the completion (a toy task for smoke tests)
    math_verify +1 / -1: math-verify's LaTeX equivalence (MATH-style answers); None if the truth won't parse

TRL-style batch functions `f(prompts, completions, **columns) -> list[float | None]` are accepted too
(trainer/reward_scoring.py tells the kinds apart and calls them).

Anything else is a dotted path to your own function: "my_pkg.my_rewards:score" or
"my_pkg.my_rewards.score". Rewards see the decoded completion text with special tokens
already stripped by the caller.
"""
from __future__ import annotations

import importlib
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

from trainer.countdown import evaluate_countdown, parse_countdown_truth

RewardFn = Callable[[str, str], float]

MAX_NUMBER_DIGITS = 100  # longer "numbers" are unparseable: keeps Fraction maths and int() cheap

# ----------------------------------------------------------------------------- number reading
# A number as people write it: optional sign, optional currency, 1,234 separators, decimals,
# and an optional "/ denominator". ASCII digits only ([0-9], not \d, which matches any script).
_UINT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
_UDEC = rf"(?:{_UINT}(?:\.[0-9]+)?|\.[0-9]+)"
# A minus is a sign only when it cannot be a binary operator ("10-5" is 10 and 5, "= -5" is -5).
_NUMBER_RE = re.compile(
    rf"(?P<neg>(?<![\w)\]}}])-)?(?:[$€£¥₹]\s?(?P<neg2>-)?)?(?P<num>{_UDEC})(?:\s*/\s*(?P<den>{_UDEC}))?")
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")  # one level of inner braces (\frac{}{})
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")


class _Num(NamedTuple):
    value: Fraction
    places: int | None  # decimal places as written; None for integers and a/b fractions
    is_ratio: bool  # written as a/b


def _normalise(text: str) -> str:
    """Unicode and LaTeX spellings -> plain ASCII forms the number regex reads."""
    text = unicodedata.normalize("NFKC", text)  # full-width digits, non-breaking spaces...
    text = text.replace("\u2212", "-").replace("\u2013", "-").replace("\u2044", "/")  # minus, en dash, ⁄
    text = text.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    return _FRAC_RE.sub(r"\1/\2", text)


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


def _parse_match(m: re.Match) -> _Num | None:
    num, den = m.group("num").replace(",", ""), m.group("den")
    if _digits(num) + (_digits(den) if den else 0) > MAX_NUMBER_DIGITS:
        return None
    value = Fraction(num)  # safe: the regex admitted only [0-9]+(.[0-9]+)?
    places = len(num.split(".")[1]) if "." in num else None
    if den is not None:
        d = Fraction(den.replace(",", ""))
        if d == 0:
            return None
        value, places = value / d, None
    if (m.group("neg") is not None) != (m.group("neg2") is not None):  # "-$-5" cancels out, as written
        value = -value
    return _Num(value, places, den is not None)


def _numbers(text: str) -> list[re.Match]:
    return list(_NUMBER_RE.finditer(text))


def _last_boxed(text: str) -> str | None:
    found = None
    for m in _BOXED_RE.finditer(text):
        found = m.group(1)
    return found


last_boxed = _last_boxed  # public: data.py reads MATH-style ground truths with it


def extract_answer(completion: str) -> str | None:
    """Content of the last closed <answer>...</answer>, or None when there is none.

    Found with rfind (linear time) rather than a lazy regex, which is quadratic on
    many unclosed tags.
    """
    end = completion.rfind("</answer>")
    if end < 0:
        return None
    start = completion.rfind("<answer>", 0, end)
    return None if start < 0 else completion[start + len("<answer>"):end]


def _answer_span(completion: str) -> str:
    """The text the final answer is read from: last <answer> (else the whole text), then its last \\boxed{}."""
    span = extract_answer(completion)
    span = completion if span is None else span
    boxed = _last_boxed(span)
    return span if boxed is None else boxed


def parse_final_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact Fraction, or None (no number, too long, x/0)."""
    ms = _numbers(_normalise(text))
    if not ms:
        return None
    n = _parse_match(ms[-1])
    return None if n is None else n.value


def _rounds_to(ratio: _Num, dec: _Num) -> bool:
    """A decimal with >= 2 places written for a non-terminating fraction (1/3 ~ 0.33) counts when it
    is that fraction correctly rounded; everything else is compared exactly."""
    if not ratio.is_ratio or dec.places is None or dec.places < 2:
        return False
    return abs(ratio.value - dec.value) <= Fraction(1, 2 * 10 ** dec.places)


def _norm_str(s: str) -> str:
    s = " ".join(unicodedata.normalize("NFKC", s).casefold().split())
    return s.rstrip(".").strip()


def reward_correct(completion: str, ground_truth: str) -> float:
    """+1.0 when the final answer equals the ground truth, else -1.0.

    The answer is read from the last <answer>...</answer> when present (never from elsewhere
    then), else from the whole completion; inside it the last \\boxed{} wins, then the last
    number. Numbers compare exactly as fractions: "12.50" == "12.5", "$1,234" == "1234",
    "-1/2" == "-0.5", "50%" == "50". A ground truth that holds no single number is compared
    as a normalised string (case, whitespace and a trailing period ignored).
    """
    gt = ground_truth.rsplit("####", 1)[-1]  # tolerate a raw GSM8K solution
    gt_norm = _normalise(_last_boxed(gt) or gt)
    gt_ms = _numbers(gt_norm)
    span = _answer_span(completion)
    if len(gt_ms) != 1:  # not a number: string comparison
        return 1.0 if _norm_str(gt) and _norm_str(span) == _norm_str(gt) else -1.0
    want = _parse_match(gt_ms[0])
    ms = _numbers(_normalise(span))
    got = _parse_match(ms[-1]) if ms else None
    if want is None or got is None:
        return -1.0
    ok = got.value == want.value or _rounds_to(want, got) or _rounds_to(got, want)
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


# ----------------------------------------------------------------------------- countdown
def reward_countdown(completion: str, ground_truth: str) -> float:
    """+1.0 when the last <answer> holds an expression equal to the target that uses each given
    number exactly once (as a multiset) and only + - * / and parentheses; else -1.0.

    ground_truth: JSON {"numbers": [3, 5, 7], "target": 22}. An optional "= ..." tail in the
    answer is ignored (the left side is what is evaluated); × and ÷ are read as * and /.
    """
    numbers, target = parse_countdown_truth(ground_truth)
    expr = extract_answer(completion)
    res = None if expr is None else evaluate_countdown(unicodedata.normalize("NFKC", expr))
    if res is None:
        return -1.0
    value, used = res
    return 1.0 if Counter(used) == Counter(numbers) and value == target else -1.0


# ----------------------------------------------------------------------------- toy
def reward_contains(completion: str, ground_truth: str) -> float:
    """1.0 if the ground-truth string occurs in the completion, else 0.0 (a toy task for smoke tests)."""
    return 1.0 if ground_truth in completion else 0.0


def reward_math_verify(completion: str, ground_truth: str) -> float | None:
    """+1 / -1 by Hugging Face's math-verify (LaTeX-aware equivalence); None when the ground truth does not
    parse (not applicable). See trainer/reward_math.py."""
    from trainer.reward_math import math_verify_reward  # lazy: sympy is slow to import

    return math_verify_reward(completion, ground_truth)


# ----------------------------------------------------------------------------- registry
REWARD_FNS: dict[str, RewardFn] = {
    "correct": reward_correct,
    "format": reward_format,
    "countdown": reward_countdown,
    "contains": reward_contains,
    "math_verify": reward_math_verify,
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` loadable by a short name (plugins call it at import time)."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARD_FNS and REWARD_FNS[name] is not fn:
            raise ValueError(f"reward name {name!r} is already registered")
        REWARD_FNS[name] = fn
        return fn
    return deco


def _import_fn(path: str) -> RewardFn:
    mod_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not mod_name or not attr:
        raise ValueError(f"unknown reward function {path!r}: use a built-in name ({', '.join(REWARD_FNS)}) "
                         f"or a dotted path 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward function {path!r}: cannot import module {mod_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward function {path!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


def load_reward_fns(spec: str | list[str]) -> list[RewardFn]:
    """Built-in names and/or dotted paths -> functions. A string may list several, comma-separated."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if not items or not all(isinstance(s, str) and s.strip() for s in items):
        raise ValueError(f"reward_fns must be a non-empty list of names or dotted paths, got {spec!r}")
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
