"""Your script's reward functions, tools and environment classes, by name: the other processes (ranks, workers, the
reward processes) import them as `module:name` or `path/to/script.py:name` (common/user_code.py), never unpickle them.

A callable defined at the top level of the running script becomes `/abs/path/my_train.py:name`: the other processes
import the script as a module, so its training code must sit under `if __name__ == "__main__":` (TRL's multi-process
launches ask the same), which script_guarded() checks. One from a module of yours becomes `module:name`. A lambda, a
closure, a method or a functools.partial has no such name: it is refused in one line saying how to define it.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any


def _main_script() -> Path | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).resolve() if path else None


def script_dir() -> Path | None:
    """The running script's folder: where its own modules import from (sys.path[0]), for every process."""
    script = _main_script()
    return script.parent if script is not None else None


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)


def _top_level_names(body: list) -> set[str]:
    """What importing the script defines: its top level outside `if __name__ == "__main__":` blocks."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)) and not _is_main_guard(node):
            for part in ("body", "orelse", "finalbody"):
                out |= _top_level_names(getattr(node, part, []))
            for handler in getattr(node, "handlers", []):
                out |= _top_level_names(handler.body)
    return out


def script_guarded() -> None:
    """The script's training code must not run again when another process imports the script for its rewards."""
    script = _main_script()
    if script is None or not script.is_file():
        return  # an interactive session or `python -c`: nothing of __main__ can be named (spec_of says so)
    if any(_is_main_guard(node) for node in ast.parse(script.read_text()).body):
        return
    raise ValueError(f"{script}: put the training code under `if __name__ == \"__main__\":` (other processes import "
                     f"this script for its reward functions, and would start training again)")


def _how(kind: str) -> str:
    if kind == "environment_factory":
        return "define it with `class MyEnv:` at the top level of your script (or a module of yours) and pass MyEnv"
    return (f"define it with `def my_{kind.rstrip('s')}(...):` at the top level of your script (or a module of "
            f"yours) and pass it by that name")


def spec_of(obj: Any, where: str, kind: str) -> str:
    """The `module:name` / `file.py:name` spec that names `obj` in every process; ValueError in one line otherwise.
    where: how the error names the argument (reward_funcs[0]); kind: reward_funcs, tools or environment_factory."""
    name = getattr(obj, "__qualname__", None)
    module_name = getattr(obj, "__module__", None)
    if not isinstance(name, str) or not module_name:
        raise ValueError(f"{where}: {obj!r} has no importable name (other processes import it by name, never by "
                         f"pickling); {_how(kind)}")
    if "<" in name or "." in name:
        what = "a lambda" if name.endswith("<lambda>") else ("a closure" if "<locals>" in name
                                                             else "not a top-level name")
        raise ValueError(f"{where}: {name.rsplit('.', 1)[-1]!r} is {what}: other processes import it by name, "
                         f"never by pickling; {_how(kind)}")
    module = sys.modules.get(module_name)
    if getattr(module, name, None) is not obj:
        raise ValueError(f"{where}: {module_name}.{name} does not name this object (redefined or made at run time); "
                         f"{_how(kind)}")
    if module_name != "__main__":
        return f"{module_name}:{name}"
    main_spec = getattr(module, "__spec__", None)
    if main_spec is not None and main_spec.name and main_spec.name != "__main__":
        return f"{main_spec.name}:{name}"  # `python -m pkg.train`: the module's own name
    script = _main_script()
    if script is None or not script.is_file():
        raise ValueError(f"{where}: {name!r} is defined in an interactive session, which other processes cannot "
                         f"import; put it in a file and import it from there")
    if name not in _top_level_names(ast.parse(script.read_text()).body):
        raise ValueError(f"{where}: {name!r} is defined under `if __name__ == \"__main__\":`, which the other "
                         f"processes do not run when they import {script.name}; define it above that block")
    return f"{script}:{name}"


def specs_of(items: Any, arg: str, kind: str) -> list[str]:
    """A list of callables and spec strings (or one of them) -> specs."""
    items = items if isinstance(items, (list, tuple)) else [items]
    return [item if isinstance(item, str) else spec_of(item, f"{arg}[{i}]", kind) for i, item in enumerate(items)]
