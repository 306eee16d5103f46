"""TRL's `environments` reward keyword across our process split.

TRL passes every reward function `environments`: the live environment instances of the batch, one per completion,
as they are after the episode (grpo_trainer.py ~1596), and a reward reads their state (`env.solved`, `env.moves`).
Here the instances live in the tool executor process and rewards are scored in the reward worker, so the tool loop
takes a copy of each rollout's instance after its last turn, before get_reward() is read and the episode ends: the
executor encodes the instance's state (`__getstate__()`) as JSON (`snapshot`, env_state.py), and the process that
calls the reward loads the class by its spec, as every process loads user code (common/user_code.py), and gives a
new instance that state (`restore`): the function gets, per completion, an instance of the episode's class in the
state the episode left it. Nothing is pickled: decoding the state runs no code.

A copy, not the live object: what a reward changes on it reaches neither the executor's instance nor get_reward(),
and each function gets its own copies. The wire form of one completion's entry: {"spec": class spec, "state":
encoded state} or {"spec": ..., "error": why, "lost": bool}. `lost`: the instance is gone (its reset() failed, or the
tool process was restarted after a timeout): TRL would still have it, we cannot read it, so the function is called
on the other completions of the group and says None ("not applicable") for those, as get_reward() does. Otherwise
the state holds something JSON cannot carry (a lock, an open file, an instance of another class; the error names
the class, the attribute and its type): a function that names `environments` stops the run (`launch.sh check` says
it first); one that only takes **kwargs is called without the keyword (said once).
"""
from __future__ import annotations

import inspect
import logging

from trainer.rewards.env_state import StateError, rebuild, state_of

log = logging.getLogger("trainer")
_warned: set[str] = set()


def takes_environments(fn) -> str | None:
    """'named' when fn declares `environments`, 'kwargs' when it takes **kwargs (TRL passes it always), else None."""
    params = inspect.signature(fn).parameters
    if "environments" in params:
        return "named"
    return "kwargs" if any(p.kind == p.VAR_KEYWORD for p in params.values()) else None


def snapshot(instance, spec: str) -> dict:
    """One episode's instance as it is now, for the wire (in the tool executor): its state as JSON, or why not."""
    from common.user_code import load_object

    cls = type(instance).__name__
    try:
        if type(instance) is not load_object(spec):  # restore() rebuilds the spec's class: a subclass would be lost
            raise StateError(f"{cls} instances cannot be copied to the reward process: {spec!r} made an instance "
                             f"of another class")
        return {"spec": spec, "state": state_of(instance)}
    except StateError as e:
        return {"spec": spec, "error": str(e), "lost": False}
    except Exception as e:  # noqa: BLE001 - the class's own __getstate__ failed: said where a reward needs the copy
        why = f"{cls} instances cannot be copied to the reward process: {type(e).__name__}: {' '.join(str(e).split())}"
        return {"spec": spec, "error": why, "lost": False}


def lost(spec: str, why: str) -> dict:
    return {"spec": spec, "error": why, "lost": True}


def restore(wire: list[dict]) -> list:
    """New instances of the episodes' classes with their states (None where lost); TypeError, one line, for one
    that could not be copied or rebuilt. Every entry is decoded afresh: each call gets its own copies."""
    from common.user_code import load_object

    out = []
    for k, entry in enumerate(wire):
        if "state" not in entry:
            if not entry.get("lost"):
                raise TypeError(f"environments[{k}]: {entry['error']}")
            out.append(None)
            continue
        cls = load_object(entry["spec"])
        try:
            out.append(rebuild(cls, entry["state"]))
        except Exception as e:  # noqa: BLE001 - the class's __new__/__setstate__ refused its own state: one line
            raise TypeError(f"environments[{k}]: {cls.__name__} could not be rebuilt from its state in the reward "
                            f"process: {type(e).__name__}: {' '.join(str(e).split())}") from e
    return out


def prepare(fn, kwargs: dict) -> tuple[dict, list[int] | None]:
    """The keyword arguments of one call of fn, `environments` restored, and the completions it is called on
    (None: all of them). Drops `environments` for a **kwargs function when the class cannot be copied."""
    wire = kwargs.get("environments")
    how = takes_environments(fn) if wire is not None else None
    if how is None:
        return {k: v for k, v in kwargs.items() if k != "environments"}, None
    try:
        envs = restore(wire)
    except TypeError as e:
        if how == "named":
            raise
        if str(e) not in _warned:
            _warned.add(str(e))
            log.warning("reward %s takes **kwargs: called without `environments` (%s)", fn.__name__, e)
        return {k: v for k, v in kwargs.items() if k != "environments"}, None
    keep = [k for k, e in enumerate(envs) if e is not None]
    if len(keep) == len(envs):
        return dict(kwargs, environments=envs), None
    n = len(envs)  # every per-completion list (columns, prompts, completions, ids) cut to the kept completions
    out = {k: [v[i] for i in keep] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
    out["environments"] = [envs[i] for i in keep]
    return out, keep


def expand(values: list, logged: dict, keep: list[int] | None, n: int) -> tuple[list, dict]:
    """A subset call's values (and its log_extra columns) back to one per completion, None where the instance was
    lost."""
    if keep is None:
        return values, logged
    if len(values) != len(keep):
        raise TypeError(f"returned {len(values)} values for the {len(keep)} completions whose environment is known")

    def wide(vals: list) -> list:
        out = [None] * n
        for i, v in zip(keep, vals):
            out[i] = v
        return out
    extra = {c: wide(v) if len(v) == len(keep) else v for c, v in logged.get("extra", {}).items()}
    return wide(values), dict(logged, extra=extra)
