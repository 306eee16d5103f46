"""An environment instance's state as JSON, for TRL's `environments` reward keyword (environments.py).

The copy of an episode's instance travels as {"spec": its class's spec, "state": the encoded state}: the state is
what `instance.__getstate__()` returns (Python's default: the instance's `__dict__`, `(dict, slots)` with
__slots__, None without attributes; a class may define its own __getstate__/__setstate__), and the other side
loads the class by its spec (common/user_code.py), makes an instance without calling __init__ (`cls.__new__`) and
gives it the state as pickle would (__setstate__, else __dict__ and the slots). Decoding never runs code or
imports anything named by the data; nothing is unpickled.

The encoding is JSON with a few one-key tagged objects for what JSON lacks:
    None, bool, int, str, finite float, list   as themselves
    dict with str keys                         a JSON object ({"$dict": [[k, v], ...]} for other keys, or when
                                               its only key starts with "$" and would read as a tag)
    nan / inf / -inf                           {"$float": "nan"} ("inf", "-inf")
    tuple, set, frozenset                      {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}
    bytes                                      {"$bytes": base64}
    numpy array / scalar (bool, int, float,    {"$ndarray": {"dtype": "int64", "shape": [2, 3], "data": [...]}},
    str dtypes; numpy only where it is used)   {"$numpy": {"dtype": "float32", "value": 0.5}}
Types are matched exactly: anything else (an open file, a lock, an instance of another class, a generator, a
subclass of a builtin such as an Enum) is refused with StateError, naming where it sits (`Board.cells[2]`).
Shared references become separate copies, as JSON has no references; a reference cycle is refused.
"""
from __future__ import annotations

import base64
import math
import sys

HOW = ("keep the state in attributes holding None, bool, int, float, str, bytes, lists, tuples, sets, dicts or numpy "
       "arrays, or define __getstate__/__setstate__ that return/accept such values")
_NUMPY_KINDS = "biufU"  # bool, int, uint, float, str: what tolist() gives back as JSON-able values
_TAGS = ("$float", "$tuple", "$set", "$frozenset", "$bytes", "$dict", "$ndarray", "$numpy")
MAX_DEPTH = 200


class StateError(TypeError):
    """The state holds a value the encoding cannot carry (said in one line, with where it sits)."""


def _type_name(value) -> str:
    """`_thread.lock`, `Piece`: a builtin's or a user file's class (common/user_code.py's module names are internal)
    by its name alone."""
    t = type(value)
    internal = t.__module__ == "builtins" or t.__module__.startswith("grpo_user_file_")
    return t.__qualname__ if internal else f"{t.__module__}.{t.__qualname__}"


def _numpy(value):
    """numpy, when value is a numpy array or scalar (numpy is only looked at once something imported it)."""
    np = sys.modules.get("numpy")
    return np if np is not None and isinstance(value, (np.ndarray, np.generic)) else None


def encode(value, path: str, _depth: int = 0, _open: set | None = None):
    """value as tagged JSON; StateError naming `path` (and the inner path) for what cannot be carried."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return value
    if t is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if _depth >= MAX_DEPTH:
        raise StateError(f"{path} is nested deeper than {MAX_DEPTH} levels")
    _open = set() if _open is None else _open
    if t in (list, tuple, set, frozenset, dict):
        if id(value) in _open:
            raise StateError(f"{path} refers back to a value that contains it (a reference cycle)")
        _open.add(id(value))
        try:
            return _container(value, path, _depth + 1, _open)
        finally:
            _open.discard(id(value))
    if t is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    np = _numpy(value)
    if np is not None and value.dtype.kind in _NUMPY_KINDS:
        if t is np.ndarray:
            data = encode(value.tolist(), path, _depth, _open)
            return {"$ndarray": {"dtype": value.dtype.str, "shape": list(value.shape), "data": data}}
        if isinstance(value, np.generic):
            return {"$numpy": {"dtype": value.dtype.str, "value": encode(value.item(), path, _depth, _open)}}
    what = f" of dtype {value.dtype}" if np is not None else ""
    raise StateError(f"{path} is a {_type_name(value)}{what}")


def _plain_keys(d: dict) -> bool:
    """Whether d can be a JSON object as it is: str keys only, and not one lone "$..." key that reads as a tag."""
    return all(type(k) is str for k in d) and not (len(d) == 1 and next(iter(d)).startswith("$"))


def _container(value, path: str, depth: int, seen: set):
    t = type(value)
    if t is dict:
        if _plain_keys(value):
            return {k: encode(v, f"{path}[{k!r}]", depth, seen) for k, v in value.items()}
        return {"$dict": [[encode(k, f"{path}.keys()[{i}]", depth, seen), encode(v, f"{path}[{k!r}]", depth, seen)]
                          for i, (k, v) in enumerate(value.items())]}
    items = [encode(v, f"{path}[{i}]", depth, seen) for i, v in enumerate(value)]
    return items if t is list else {f"${t.__name__}": items}


def decode(data):
    """The value encode() wrote; ValueError for what encode() never writes."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is not dict:
        raise ValueError(f"not an encoded state value: {type(data).__name__}")
    if len(data) != 1 or next(iter(data)) not in _TAGS:
        return {k: decode(v) for k, v in data.items()}
    (tag, body), = data.items()
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError(f"not an encoded float: {body!r}")
        return float(body)
    if tag in ("$tuple", "$set", "$frozenset"):
        return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](decode(v) for v in body)
    if tag == "$bytes":
        return base64.b64decode(body, validate=True)
    if tag == "$dict":
        return {decode(k): decode(v) for k, v in body}
    import numpy as np

    dtype = np.dtype(body["dtype"])
    if dtype.kind not in _NUMPY_KINDS:
        raise ValueError(f"numpy dtype {dtype} is not carried")
    if tag == "$numpy":
        return dtype.type(decode(body["value"]))
    return np.array(decode(body["data"]), dtype=dtype).reshape(body["shape"])


def state_of(instance) -> object:
    """The instance's state, encoded; StateError, one line, naming the class, where and what, and what to do."""
    cls = type(instance).__name__
    own = type(instance).__getstate__ is not object.__getstate__
    try:
        base = next((b for b in (dict, list, set) if isinstance(instance, b)), None)
        if base is not None and not own:  # its items are not in the default state
            raise StateError(f"{cls} derives from {base.__name__}: its items are not in its __getstate__()")
        state = instance.__getstate__()
        if own:
            return encode(state, f"{cls}.__getstate__()")
        if type(state) is tuple:  # (the __dict__ or None, the __slots__' values): attributes by name
            return {"$tuple": [None if part is None else _attributes(part, cls) for part in state]}
        return None if state is None else _attributes(state, cls)
    except StateError as e:
        raise StateError(f"{cls} instances cannot be copied to the reward process: {e}; {HOW}") from None


def _attributes(attrs: dict, cls: str) -> dict:
    """The attributes by name (paths `Board.cells`); encode()'s tagged pairs where a plain object would misread."""
    if _plain_keys(attrs):
        return {name: encode(v, f"{cls}.{name}") for name, v in attrs.items()}
    return encode(attrs, cls)


def rebuild(cls, data):
    """An instance of cls with the decoded state, without calling __init__, as pickle rebuilds one."""
    obj = cls.__new__(cls)
    state = decode(data)
    if state is None:  # pickle does not call __setstate__ for a None state either
        return obj
    if hasattr(obj, "__setstate__"):
        obj.__setstate__(state)
        return obj
    attrs, slots = state if type(state) is tuple else (state, None)
    if attrs:
        obj.__dict__.update(attrs)
    for name, v in (slots or {}).items():
        setattr(obj, name, v)
    return obj
