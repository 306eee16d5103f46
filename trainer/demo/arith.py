"""The demo's synthetic reasoning task: `a o b o c` (e.g. "3+4*2") with digits 0-9 and + - *.

All 10 x 3 x 10 x 3 x 10 = 9,000 problems exist; a fixed seeded permutation puts 1,000 in
the held-out split. Problems and worked solutions are written without spaces ("3+4*2"), so
every character is one token of the tiny tokenizer (about half the length of a spaced form).
Worked solutions in the R1 format (for the cold-start SFT) apply * first, then + and - left to
right:  "<think>4*2=8,3+8=11</think><answer>11</answer>".
"""
from __future__ import annotations

import itertools
import random

from trainer.data.example import Example

OPS = "+-*"
HELD_OUT = 1000
SPLIT_SEED = 1234  # fixed: the held-out set is the same for every run seed


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def solve(a: int, o1: str, b: int, o2: str, c: int) -> tuple[list[str], int]:
    """Reasoning steps and the value, with * binding tighter than + and -."""
    if o2 == "*" and o1 != "*":
        bc = b * c
        return [f"{b}*{c}={bc}", f"{a}{o1}{bc}={_apply(a, o1, bc)}"], _apply(a, o1, bc)
    ab = _apply(a, o1, b)
    return [f"{a}{o1}{b}={ab}", f"{ab}{o2}{c}={_apply(ab, o2, c)}"], _apply(ab, o2, c)


def parse(problem: str) -> tuple[int, str, int, str, int]:
    """"3+4*2" -> (3, "+", 4, "*", 2): digits are single characters."""
    if len(problem) != 5:
        raise ValueError(f"not an arith problem: {problem!r}")
    return int(problem[0]), problem[1], int(problem[2]), problem[3], int(problem[4])


def solution_text(problem: str) -> str:
    steps, value = solve(*parse(problem))
    return f"<think>{','.join(steps)}</think><answer>{value}</answer>"


def all_problems() -> list[str]:
    return [f"{a}{o1}{b}{o2}{c}" for a, o1, b, o2, c in itertools.product(range(10), OPS, range(10), OPS, range(10))]


def load_arith(split: str = "train") -> list[Example]:
    """split: 'train' (8,000 problems) or 'test' (the 1,000 held out)."""
    if split not in ("train", "test"):
        raise ValueError(f"arith has splits 'train' and 'test', not {split!r}")
    probs = all_problems()
    random.Random(SPLIT_SEED).shuffle(probs)
    chosen = probs[:HELD_OUT] if split == "test" else probs[HELD_OUT:]
    out = []
    for p in chosen:
        out.append(Example(prompt=p, ground_truth=str(solve(*parse(p))[1])))
    return out
