"""Environment classes for TRL's `environments` copies (trainer/rewards/env_state.py): their state crosses from the
tool executor to the reward process as JSON. Each checks its own copy (`_check`): values and exact types as its
reset() left them."""
from __future__ import annotations

import math
import threading

import numpy as np


def typical(start: int) -> dict:
    """What environments commonly hold: numbers (nan, inf, big ints), strings, nested lists/dicts/tuples/sets,
    non-str dict keys, a dict whose only key reads like a tag, bytes, numpy arrays and scalars."""
    return {"value": start, "big": 2 ** 70, "ratio": 0.5, "nan": math.nan, "inf": -math.inf, "name": "board",
            "done": False, "none": None, "cells": [start, [1, 2, (3, 4)], {"k": {5, 6}}], "pos": (1, (2, 3)),
            "seen": {3, 1}, "frozen": frozenset({"a"}), "by_cell": {0: "x", (1, 2): "y", None: 1.5, "s": [math.inf]},
            "tagged": {"$set": [1]}, "raw": b"\x00\xff", "empty": ({}, [], (), set()),
            "grid": np.arange(6, dtype=np.int32).reshape(2, 3), "probs": np.array([0.25, np.nan], dtype=np.float32),
            "score": np.float64(2.5), "count": np.int64(7), "none_yet": np.zeros((0, 3)),
            "labels": np.array(["a", "bc"])}


def same(a, b) -> bool:
    """Equal, with the same types all the way down (nan equal to nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, (float, np.floating)) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


class Rich:
    def reset(self, **kwargs) -> str:
        self.__dict__.update(typical(int(kwargs.get("start", 0))))
        return "A board."

    def _check(self) -> bool:
        return same(self.__dict__, typical(self.value))


class Slotted:
    """__slots__, one left unset."""
    __slots__ = ("value", "moves", "unset")

    def reset(self, **kwargs) -> None:
        self.value = int(kwargs.get("start", 0))
        self.moves = [(0, 1)]

    def _check(self) -> bool:
        return same(self.moves, [(0, 1)]) and not hasattr(self, "unset") and not hasattr(self, "__dict__")


class Custom:
    """Holds a lock: its own __getstate__ leaves it out, its __setstate__ makes a new one."""

    def reset(self, **kwargs) -> None:
        self.value = int(kwargs.get("start", 0))
        self.lock = threading.Lock()
        self.restored = False

    def __getstate__(self) -> dict:
        return {"value": self.value, "version": 2}

    def __setstate__(self, state: dict) -> None:
        assert state["version"] == 2
        self.value, self.lock, self.restored = state["value"], threading.Lock(), True

    def _check(self) -> bool:
        return self.restored and isinstance(self.lock, type(threading.Lock()))


class Piece:
    """A plain object of another class: not copied (no class is instantiated from the data)."""


class Nested:
    def reset(self, **kwargs) -> None:
        self.value = int(kwargs.get("start", 0))
        self.pieces = {"king": [0, Piece()]}
