"""The demo's synthetic reasoning task: `a o b o c` with digits 0-9 and + - *.

All 10 x 3 x 10 x 3 x 10 = 9,000 problems exist; a fixed seeded permutation puts 1,000 in
the held-out split. Worked solutions in the R1 format (for the cold-start SFT) apply * first,
then + and - left to right:  "<think> 4 * 2 = 8 , 3 + 8 = 11 </think> <answer> 11 </answer>".
"""
from __future__ import annotations

import itertools
import random

from trainer.data import Example

OPS = "+-*"
HELD_OUT = 1000
SPLIT_SEED = 1234  # fixed: the held-out set is the same for every run seed


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def solve(a: int, o1: str, b: int, o2: str, c: int) -> tuple[list[str], int]:
    """Reasoning steps and the value, with * binding tighter than + and -."""
    if o2 == "*" and o1 != "*":
        bc = b * c
        return [f"{b} * {c} = {bc}", f"{a} {o1} {bc} = {_apply(a, o1, bc)}"], _apply(a, o1, bc)
    ab = _apply(a, o1, b)
    return [f"{a} {o1} {b} = {ab}", f"{ab} {o2} {c} = {_apply(ab, o2, c)}"], _apply(ab, o2, c)


def solution_text(problem: str) -> str:
    a, o1, b, o2, c = problem.split()
    steps, value = solve(int(a), o1, int(b), o2, int(c))
    return f"<think> {' , '.join(steps)} </think> <answer> {value} </answer>"


def all_problems() -> list[str]:
    return [f"{a} {o1} {b} {o2} {c}" for a, o1, b, o2, c in itertools.product(range(10), OPS, range(10), OPS, range(10))]


def load_arith(split: str = "train") -> list[Example]:
    """split: 'train' (8,000 problems) or 'test' (the 1,000 held out)."""
    if split not in ("train", "test"):
        raise ValueError(f"arith has splits 'train' and 'test', not {split!r}")
    probs = all_problems()
    random.Random(SPLIT_SEED).shuffle(probs)
    chosen = probs[:HELD_OUT] if split == "test" else probs[HELD_OUT:]
    out = []
    for p in chosen:
        a, o1, b, o2, c = p.split()
        out.append(Example(prompt=p, ground_truth=str(solve(int(a), o1, int(b), o2, int(c))[1])))
    return out
