"""The built-in `math_verify` reward: Hugging Face's math-verify library, as open-r1's accuracy reward uses it.

math-verify's own timeouts use signal.alarm, which only works in a process's main thread: we pass them only
there (the reward worker process calls rewards on its main thread; reward_timeout bounds the call anyway).
"""
from __future__ import annotations

import threading

from trainer.rewards.answers import extract_answer


def math_verify_reward(completion: str, ground_truth: str) -> float | None:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    limits = {} if main else {"parsing_timeout": None}
    gt = ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"
    gold = parse(gt, extraction_mode="first_match", **limits)
    if not gold:
        return None  # the ground truth itself is unreadable: not applicable, not a wrong answer
    span = extract_answer(completion)
    span = completion if span is None else span
    config = [LatexExtractionConfig(normalization_config=NormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=True), ExprExtractionConfig()]
    answer = parse(span, extraction_config=config, extraction_mode="first_match", **limits)
    ok = verify(gold, answer, **({} if main else {"timeout_seconds": None}))
    return 1.0 if ok else -1.0
