"""The JSON state contract of TRL's `environments` copies (trainer/rewards/env_state.py), in one process: what
round-trips with its exact types, what is refused and how it is said, and that decoding runs no code."""
from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from tests.env_state_user import same, typical
from trainer.rewards.env_state import StateError, decode, encode, rebuild, state_of
from trainer.rewards.environments import restore, snapshot


def wire(value):
    return json.loads(json.dumps(value, allow_nan=False))  # strict JSON, as the executor's pipe carries it


def test_typical_values_round_trip_with_their_types():
    state = typical(3)
    assert same(decode(wire(encode(state, "Board"))), state)
    assert encode((1, [2.0, "x"]), "p") == {"$tuple": [1, [2.0, "x"]]}  # readable: JSON where JSON has the type
    assert encode({"$tuple": 1}, "p") == {"$dict": [["$tuple", 1]]}  # a dict that would read as a tag is escaped
    assert math.copysign(1, decode(wire(encode(-0.0, "p")))) == -1 and decode(encode(10 ** 30, "p")) == 10 ** 30


class Board:
    def __init__(self):
        self.cells = [0, (1, 2), {3: {4}}]


def test_an_instance_rebuilds_without_init_and_a_copy_is_independent():
    b = Board()
    copy = rebuild(Board, wire(state_of(b)))
    assert type(copy) is Board and same(copy.__dict__, b.__dict__)
    copy.cells[2][3].add(5)
    assert b.cells[2][3] == {4}
    assert rebuild(Board, state_of(Board.__new__(Board))).__dict__ == {}  # no attributes: state None, as pickle


class Link:
    pass


@pytest.mark.parametrize("value,where,what", [
    ([0, 1, threading.Lock()], "Board.cells[2]", "_thread.lock"),
    ({"k": [Link()]}, "Board.cells['k'][0]", f"{__name__}.Link"),
    ({0: 1, (1, Link()): 0}, "Board.cells.keys()[1][1]", f"{__name__}.Link"),
    ((x for x in ()), "Board.cells", "generator"),
    (np.array([1 + 2j]), "Board.cells", "numpy.ndarray of dtype complex128"),
    (np.array([Link()], dtype=object), "Board.cells", "numpy.ndarray of dtype object"),
    (bytearray(b"x"), "Board.cells", "bytearray"),
])
def test_what_cannot_be_carried_is_named_with_where_it_sits(value, where, what):
    b = Board()
    b.cells = value
    with pytest.raises(StateError) as e:
        state_of(b)
    msg = str(e.value)
    assert msg.startswith(f"Board instances cannot be copied to the reward process: {where} is a {what}; keep the "
                          f"state in attributes holding None, bool"), msg
    assert msg.endswith("or define __getstate__/__setstate__ that return/accept such values") and "\n" not in msg


def test_cycles_deep_nesting_and_builtin_subclasses_are_refused():
    b = Board()
    b.cells.append(b.cells)
    with pytest.raises(StateError, match=r"Board.cells\[3\] refers back to a value that contains it"):
        state_of(b)
    shared = [1]
    b.cells = [shared, shared]  # shared, not a cycle: two copies
    assert decode(state_of(b))["cells"] == [[1], [1]]
    deep = []
    for _ in range(300):
        deep = [deep]
    b.cells = deep
    with pytest.raises(StateError, match="nested deeper than 200 levels"):
        state_of(b)

    class Table(dict):
        pass
    with pytest.raises(StateError, match="Table derives from dict: its items are not in its __getstate__"):
        state_of(Table(a=1))


class Slots:
    __slots__ = ("a", "b", "__dict__")


class Own:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = 1

    def __getstate__(self):
        return (self.n, "v1")

    def __setstate__(self, state):
        self.n, self.version, self.lock = state[0], state[1], threading.Lock()


def test_slots_and_a_classes_own_getstate_setstate():
    s = Slots()
    s.a, s.extra = (1,), {2}
    copy = rebuild(Slots, wire(state_of(s)))
    assert copy.a == (1,) and copy.extra == {2} and not hasattr(copy, "b")
    copy = rebuild(Own, wire(state_of(Own())))
    assert copy.n == 1 and copy.version == "v1" and copy.lock is not None
    o = Own()
    o.n = [threading.Lock()]
    with pytest.raises(StateError, match=r"Own.__getstate__\(\)\[0\]\[0\] is a _thread.lock"):
        state_of(o)


class Broken:
    def __getstate__(self):
        raise RuntimeError("no\nstate")

    def __setstate__(self, state):
        raise ValueError("bad state")


def test_snapshot_and_restore_say_failures_in_one_line():
    spec = f"{__name__}:Broken"
    entry = snapshot(Broken(), spec)
    assert entry == {"spec": spec, "lost": False,
                     "error": "Broken instances cannot be copied to the reward process: RuntimeError: no state"}
    with pytest.raises(TypeError, match=r"^environments\[0\]: Broken instances cannot be copied"):
        restore([entry])
    with pytest.raises(TypeError, match=r"^environments\[0\]: Broken could not be rebuilt from its state in the "
                                        r"reward process: ValueError: bad state$"):
        restore([{"spec": spec, "state": {"x": 1}}])

    class Sub(Board):
        pass
    entry = snapshot(Sub(), f"{__name__}:Board")  # the spec's class is what the other side rebuilds
    assert "Sub instances cannot be copied" in entry["error"] and "made an instance of another class" in entry["error"]
    copy, = restore([snapshot(Board(), f"{__name__}:Board")])
    assert type(copy) is Board and copy.cells == [0, (1, 2), {3: {4}}]


def test_decoding_refuses_what_encode_never_writes():
    for bad in ({"$float": "1e999x"}, {"$ndarray": {"dtype": "|O", "shape": [1], "data": [None]}},
                {"$numpy": {"dtype": "<c16", "value": 1}}):
        with pytest.raises(ValueError):
            decode(bad)
    with pytest.raises(ValueError):
        decode({"$bytes": "not base64!"})
