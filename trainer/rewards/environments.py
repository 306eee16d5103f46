"""TRL's `environments` reward keyword across our process split.

TRL passes every reward function `environments`: the live environment instances of the batch, one per completion,
as they are after the episode (grpo_trainer.py ~1596), and a reward reads their state (`env.solved`, `env.moves`).
Here the instances live in the tool executor process and rewards are scored in the reward worker, so the tool loop
takes a copy of each rollout's instance after its last turn, before get_reward() is read and the episode ends
(pickled in the executor: `snapshot`), and the process that calls the reward unpickles it (`restore`): the function
gets, per completion, an instance of the episode's class in the state the episode left it.

A copy, not the live object: what a reward changes on it reaches neither the executor's instance nor get_reward(),
and each function gets its own copies. The wire form of one completion's entry: {"spec": class spec, "pickle":
base64} or {"spec": ..., "error": why, "lost": bool}. `lost`: the instance is gone (its reset() failed, or the tool
process was restarted after a timeout): TRL would still have it, we cannot read it, so the function is called on
the other completions of the group and says None ("not applicable") for those, as get_reward() does. Otherwise the
class cannot be pickled: a function that names `environments` stops the run (`launch.sh check` says it first); one
that only takes **kwargs is called without the keyword (said once).
"""
from __future__ import annotations

import base64
import inspect
import logging
import pickle

log = logging.getLogger("trainer")
_warned: set[str] = set()


def takes_environments(fn) -> str | None:
    """'named' when fn declares `environments`, 'kwargs' when it takes **kwargs (TRL passes it always), else None."""
    params = inspect.signature(fn).parameters
    if "environments" in params:
        return "named"
    return "kwargs" if any(p.kind == p.VAR_KEYWORD for p in params.values()) else None


def snapshot(instance, spec: str) -> dict:
    """One episode's instance as it is now, for the wire (in the tool executor)."""
    try:
        data = pickle.dumps(instance)
    except Exception as e:  # noqa: BLE001 - any pickling failure: said where a reward needs the copy
        why = f"{type(instance).__name__} instances cannot be copied to the reward process (pickle: " \
              f"{type(e).__name__}: {e})"
        return {"spec": spec, "error": why, "lost": False}
    return {"spec": spec, "pickle": base64.b64encode(data).decode("ascii")}


def lost(spec: str, why: str) -> dict:
    return {"spec": spec, "error": why, "lost": True}


def restore(wire: list[dict]) -> list:
    """The instances (None where lost); TypeError, one line, for one that could not be copied. The class is
    loaded by its spec first, so an instance of a class from a file (common/user_code.py) unpickles here too."""
    from common.user_code import load_object

    out = []
    for k, entry in enumerate(wire):
        if "pickle" not in entry:
            if not entry.get("lost"):
                raise TypeError(f"environments[{k}]: {entry['error']}")
            out.append(None)
            continue
        load_object(entry["spec"])
        out.append(pickle.loads(base64.b64decode(entry["pickle"])))
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
