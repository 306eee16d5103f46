"""Reading answers out of completions: the last <answer>...</answer>, the last \\boxed{}, and numbers as people
write them (exact Fractions). The base of the rewards package: reward functions and data loading both use it."""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import NamedTuple

MAX_NUMBER_DIGITS = 100  # longer "numbers" are unparseable: keeps Fraction maths and int() cheap


def need_ground_truth(ground_truth: str | None, reward: str) -> str:
    """The ground truth of a reward that compares against one; prompt-only rows (None) are refused by name. The run
    refuses such data before it starts (trainer/data/run_data.py); this is the same line for direct callers."""
    if ground_truth is None:
        raise ValueError(f"reward {reward!r} needs a ground truth, and this example has none (prompt-only data: no "
                         f"answer column); use rewards that need none, or set answer_column")
    return ground_truth

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


def normalise(text: str) -> str:
    """Unicode and LaTeX spellings -> plain ASCII forms the number regex reads."""
    text = unicodedata.normalize("NFKC", text)  # full-width digits, non-breaking spaces...
    text = text.replace("\u2212", "-").replace("\u2013", "-").replace("\u2044", "/")  # minus, en dash, ⁄
    text = text.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    return _FRAC_RE.sub(r"\1/\2", text)


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


def parse_number(m: re.Match) -> _Num | None:
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


def find_numbers(text: str) -> list[re.Match]:
    return list(_NUMBER_RE.finditer(text))


def last_boxed(text: str) -> str | None:
    found = None
    for m in _BOXED_RE.finditer(text):
        found = m.group(1)
    return found



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


def answer_span(completion: str) -> str:
    """The text the final answer is read from: last <answer> (else the whole text), then its last \\boxed{}."""
    span = extract_answer(completion)
    span = completion if span is None else span
    boxed = last_boxed(span)
    return span if boxed is None else boxed


def parse_final_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact Fraction, or None (no number, too long, x/0)."""
    ms = find_numbers(normalise(text))
    if not ms:
        return None
    n = parse_number(ms[-1])
    return None if n is None else n.value


def rounds_to(ratio: _Num, dec: _Num) -> bool:
    """A decimal with >= 2 places written for a non-terminating fraction (1/3 ~ 0.33) counts when it
    is that fraction correctly rounded; everything else is compared exactly."""
    if not ratio.is_ratio or dec.places is None or dec.places < 2:
        return False
    return abs(ratio.value - dec.value) <= Fraction(1, 2 * 10 ** dec.places)


def norm_str(s: str) -> str:
    s = " ".join(unicodedata.normalize("NFKC", s).casefold().split())
    return s.rstrip(".").strip()
