"""Reward functions: answer extraction, number reading, format, countdown, registry."""
from __future__ import annotations

import json
import random
import time

import pytest

from trainer.rewards import (
    REWARD_FNS,
    extract_answer,
    load_reward_fns,
    parse_final_number,
    reward_contains,
    reward_correct,
    reward_countdown,
    reward_format,
    reward_total,
    score_completion,
)
from trainer.rewards.countdown import evaluate_countdown


def ans(text: str) -> str:
    return f"<think>working</think><answer>{text}</answer>"


# ----------------------------------------------------------------------------- correct
@pytest.mark.parametrize("completion, truth", [
    (ans("72"), "72"),
    (ans(" 72 "), "72"),
    (ans("-5"), "-5"),
    (ans("−5"), "-5"),  # unicode minus
    (ans("x = -3"), "-3"),
    (ans("3.5"), "3.5"),
    (ans("12.50"), "12.5"),
    (ans("12.5"), "12.50"),
    (ans("0.5"), ".5"),
    (ans("1,234"), "1234"),
    (ans("1234"), "1,234"),
    (ans("1,234,567.25"), "1234567.25"),
    (ans("$5"), "5"),
    (ans("€5"), "5"),
    (ans("£1,200.00"), "1200"),
    (ans("-$5"), "-5"),
    (ans("$-5"), "-5"),
    (ans("3/4"), "0.75"),
    (ans("-1/2"), "-0.5"),
    (ans("6/8"), "3/4"),
    (ans(r"\boxed{42}"), "42"),
    (ans(r"\boxed{\frac{3}{4}}"), "0.75"),
    (r"so the result is \boxed{42}.", "42"),
    (ans("50%"), "50"),
    (ans("72."), "72"),
    (ans("The answer is 72 apples."), "72"),
    (ans("７２"), "72"),  # full-width digits
    (ans("0.33"), "1/3"),  # correctly rounded decimal of a non-terminating fraction
])
def test_correct_equal(completion: str, truth: str) -> None:
    assert reward_correct(completion, truth) == 1.0


@pytest.mark.parametrize("completion, truth", [
    (ans("71"), "72"),
    (ans("5"), "-5"),  # a dropped minus sign is wrong
    (ans("-5"), "5"),
    (ans("1.234"), "1234"),  # a decimal point is not a thousands separator
    (ans("12.51"), "12.5"),
    (ans("3/4"), "0.7"),
    (ans("3/0"), "0"),  # division by zero is unparseable, not a crash
    (ans("0.3"), "1/3"),  # one decimal place is too coarse to count as 1/3
    (ans("no number here"), "72"),
    (ans(""), "72"),
    ("", "72"),
    ("<answer></answer>", "72"),
])
def test_correct_wrong(completion: str, truth: str) -> None:
    assert reward_correct(completion, truth) == -1.0


def test_binary_minus_is_not_a_sign() -> None:
    assert reward_correct(ans("10-3"), "3") == 1.0  # "10-3": last number is 3, not -3
    assert parse_final_number("= -7") == -7


def test_last_answer_wins() -> None:
    c = "<think>x</think><answer>5</answer> oops <answer>7</answer>"
    assert reward_correct(c, "7") == 1.0
    assert reward_correct(c, "5") == -1.0
    assert extract_answer(c) == "7"


def test_fallback_to_last_number_without_answer_tag() -> None:
    assert reward_correct("48/2 = 24, and 48 + 24 = 72", "72") == 1.0
    assert reward_correct("48/2 = 24, and 48 + 24 = 72 so", "24") == -1.0
    assert reward_correct("<think>the answer is 72</think>", "72") == 1.0


def test_number_only_in_think_does_not_count_when_answer_present() -> None:
    c = "<think>so it is 72</think><answer>I am not sure</answer>"
    assert reward_correct(c, "72") == -1.0


def test_unclosed_answer_falls_back_to_whole_text() -> None:
    assert extract_answer("<think>1</think><answer>72") is None
    assert reward_correct("<think>1</think><answer>72", "72") == 1.0


def test_last_boxed_wins_inside_answer() -> None:
    assert reward_correct(ans(r"\boxed{1} then \boxed{2}"), "2") == 1.0


def test_ground_truth_forms() -> None:
    assert reward_correct(ans("1234"), "1,234") == 1.0
    assert reward_correct(ans("72"), "She sold 48+24 = 72 clips.\n#### 72") == 1.0  # raw GSM8K solution
    assert reward_correct(ans("18"), "$18") == 1.0


def test_non_numeric_ground_truth_compares_normalised_strings() -> None:
    assert reward_correct(ans("  Paris. "), "paris") == 1.0
    assert reward_correct(ans("PARIS  is   nice"), "paris is nice") == 1.0
    assert reward_correct(ans("London"), "Paris") == -1.0
    assert reward_correct(ans(""), "") == -1.0


def test_non_ascii_text() -> None:
    assert reward_correct(ans("答案是 42 个苹果"), "42") == 1.0
    assert reward_correct(ans("答案是四十二"), "42") == -1.0
    assert reward_correct(ans("٤٢"), "42") == -1.0  # only ASCII (or full-width) digits are numbers
    assert reward_format("<think>思考 🤔</think>\n<answer>42</answer>") == 1.25


def test_huge_numbers_are_fast_and_wrong() -> None:
    big = "9" * 100_000
    t0 = time.perf_counter()
    assert reward_correct(big, "9") == -1.0
    assert reward_correct(ans(big), big) == -1.0  # over the digit cap: unparseable
    assert reward_correct(ans("1" + ",000" * 30_000), "1") == -1.0
    assert reward_correct(ans("1/" + big), "0") == -1.0
    assert reward_correct("<answer>" * 50_000 + "5", "5") == 1.0  # many unclosed tags: linear time
    assert reward_correct(r"\boxed{" * 20_000 + "5", "5") == 1.0
    assert reward_format("<think>" * 50_000) == -1.0
    assert time.perf_counter() - t0 < 5.0
    assert parse_final_number(big) is None


def test_random_integers_roundtrip() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(-10 ** 9, 10 ** 9)
        style = rng.choice(["plain", "comma", "dollar", "boxed", "decimal"])
        text = {"plain": str(n), "comma": f"{n:,}", "dollar": f"${n:,}" if n >= 0 else f"-${-n:,}",
                "boxed": rf"\boxed{{{n}}}", "decimal": f"{n}.00"}[style]
        assert reward_correct(ans(text), str(n)) == 1.0, text
        assert reward_correct(ans(text), str(n + 1)) == -1.0, text


# ----------------------------------------------------------------------------- format
@pytest.mark.parametrize("completion", [
    "<think>a</think><answer>b</answer>",
    "<think>a</think>\n<answer>b</answer>",
    "  \n<think>\nstep 1\nstep 2\n</think>\n\n<answer> 72 </answer>\n  ",
    "<think></think><answer></answer>",
])
def test_format_good(completion: str) -> None:
    assert reward_format(completion) == 1.25


@pytest.mark.parametrize("completion", [
    "",
    "72",
    "<think>a</think>",
    "<answer>b</answer>",
    "<think>a</think><answer>b",
    "Sure! <think>a</think><answer>b</answer>",
    "<think>a</think><answer>b</answer> hope that helps",
    "<think>a</think> so <answer>b</answer>",
    "<think>a</think><answer>b</answer><answer>c</answer>",
    "<think>a</think><think>a</think><answer>b</answer>",
    "<think>a<think>b</think></think><answer>c</answer>",
    "<think>a</think><answer>b<answer>c</answer></answer>",
    "<think>a<answer>b</answer></think>",
    "<answer>b</answer><think>a</think>",
    "</think><think>a<answer>b</answer>",
    "<THINK>a</THINK><ANSWER>b</ANSWER>",
])
def test_format_bad(completion: str) -> None:
    assert reward_format(completion) == -1.0


def test_total_is_sum() -> None:
    good = "<think>48 + 24 = 72</think><answer>72</answer>"
    assert reward_total(good, "72") == 2.25
    assert reward_total(good, "71") == 0.25
    assert reward_total("72", "72") == 0.0
    assert reward_total("", "72") == -2.0


# ----------------------------------------------------------------------------- countdown
CD = json.dumps({"numbers": [3, 5, 7], "target": 22})


@pytest.mark.parametrize("expr", ["3*5+7", "7+3*5", "(3 * 5) + 7", "5*3+7 = 22", "3×5+7", " ( 7 + ( 5 * 3 ) ) "])
def test_countdown_correct(expr: str) -> None:
    assert reward_countdown(f"<think>t</think><answer>{expr}</answer>", CD) == 1.0


@pytest.mark.parametrize("expr", [
    "3*5-7",  # wrong value
    "3*5+7+3-3",  # number reused
    "3*5+7*1",  # number not given
    "15+7",  # numbers missing/combined
    "3**2+13",  # power disallowed
    "22",
    "(3+5)*7//2",  # floor division disallowed
    "3.0*5+7",  # floats disallowed
    "True*22",
    "",
    "abc",
    "(3+5",
    "3 5 7",
])
def test_countdown_wrong(expr: str) -> None:
    assert reward_countdown(f"<answer>{expr}</answer>", CD) == -1.0


def test_countdown_exact_fractions_and_division() -> None:
    gt = json.dumps({"numbers": [1, 3, 4, 6], "target": 24})
    assert reward_countdown("<answer>6/(1-3/4)</answer>", gt) == 1.0  # needs exact 1/4, not float
    assert reward_countdown("<answer>6/(3-3)</answer>", json.dumps({"numbers": [6, 3, 3], "target": 0})) == -1.0
    assert evaluate_countdown("7/0") is None
    assert reward_countdown("<answer>-3+5*7-10</answer>", json.dumps({"numbers": [3, 5, 7, 10], "target": 22})) == 1.0


def test_countdown_never_evaluates_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.rewards.countdown as rw

    parsed: list[str] = []
    real_parse = rw.ast.parse
    monkeypatch.setattr(rw.ast, "parse", lambda src, *a, **k: parsed.append(src) or real_parse(src, *a, **k))
    for bad in ["__import__('os')", "__import__('os').system('echo pwned')", "exec('1')", "(lambda: 22)()",
                "[3,5,7]", "3;5;7", "3*5+7 if 1 else 0"]:
        assert reward_countdown(f"<answer>{bad}</answer>", CD) == -1.0
    assert parsed == []  # rejected by the character whitelist before even being parsed
    assert reward_countdown("<answer>3*5+7</answer>", CD) == 1.0
    assert parsed == ["3*5+7"]


def test_countdown_limits() -> None:
    assert evaluate_countdown("(" * 100 + "3" + ")" * 100) is None  # too long / too deep
    assert evaluate_countdown("-" * 150 + "3") is None
    assert evaluate_countdown("1+" * 150 + "1") is None  # over the length cap
    assert evaluate_countdown("(((3)))") == (3, [3])


def test_countdown_uses_last_answer_and_needs_one() -> None:
    assert reward_countdown("<answer>1</answer><answer>3*5+7</answer>", CD) == 1.0
    assert reward_countdown("3*5+7", CD) == -1.0


def test_countdown_bad_ground_truth_raises() -> None:
    for gt in ["22", "{}", '{"numbers": [], "target": 1}', '{"numbers": [1.5], "target": 1}', "not json"]:
        with pytest.raises(ValueError, match="countdown ground truth"):
            reward_countdown("<answer>1</answer>", gt)


# ----------------------------------------------------------------------------- contains
def test_contains() -> None:
    assert reward_contains("the cat sat", "cat") == 1.0
    assert reward_contains("the dog sat", "cat") == 0.0


# ----------------------------------------------------------------------------- registry
def test_load_by_name_and_path() -> None:
    assert load_reward_fns(["correct", "format"]) == [reward_correct, reward_format]
    assert load_reward_fns("correct, format") == [reward_correct, reward_format]
    assert load_reward_fns("countdown")[0] is reward_countdown
    assert load_reward_fns("contains")[0] is reward_contains
    assert load_reward_fns(["trainer.rewards:reward_total"]) == [reward_total]
    assert load_reward_fns(["trainer.rewards.reward_total"]) == [reward_total]
    assert set(REWARD_FNS) >= {"correct", "format", "countdown", "contains"}


@pytest.mark.parametrize("spec, msg", [
    ("nope", "unknown reward function"),
    ("no_such_module_xyz:fn", "cannot import"),
    ("trainer.rewards:no_such_fn", "no callable"),
    ("trainer.rewards:MAX_NUMBER_DIGITS", "no callable"),
    ("", "list of names"),
    (["correct", " "], "list of names"),
])
def test_load_errors(spec, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        load_reward_fns(spec)


def test_an_empty_list_is_no_function() -> None:
    """reward_fns: [] is valid where an environment's get_reward() gives the reward (GRPOConfig refuses it
    otherwise, tests/test_env_rewards.py)."""
    assert load_reward_fns([]) == []


def test_score_completion_components() -> None:
    fns = load_reward_fns(["correct", "format"])
    total, parts = score_completion("<think>t</think><answer>72</answer>", "72", fns)
    assert (total, parts) == (2.25, {"correct": 1.0, "format": 1.25})
    total, parts = score_completion("72", "72", fns + [reward_correct])
    assert (total, parts) == (1.0, {"correct": 1.0, "format": -1.0, "correct#2": 1.0})


def test_score_completion_rejects_nan() -> None:
    def nan_reward(c: str, g: str) -> float:
        return float("nan")

    with pytest.raises(ValueError, match="nan_reward"):
        score_completion("x", "y", [nan_reward])


def test_plugin_module_and_register(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.rewards.registry as rw

    (tmp_path / "my_plugin_rewards.py").write_text(
        "from trainer.rewards import register_reward\n\n"
        "def length_penalty(completion, ground_truth):\n    return -len(completion) / 100\n\n"
        "@register_reward('always_one')\ndef always_one(completion, ground_truth):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rw, "REWARD_FNS", dict(rw.REWARD_FNS))  # keep the registration local to this test
    fns = load_reward_fns(["format", "my_plugin_rewards:length_penalty"])
    total, parts = score_completion("x" * 50, "", fns)
    assert parts == {"format": -1.0, "length_penalty": -0.5} and total == -1.5
    assert load_reward_fns("always_one")[0]("", "") == 1.0  # registered when the plugin was imported
    with pytest.raises(ValueError, match="already registered"):
        rw.register_reward("correct")(lambda c, g: 0.0)
