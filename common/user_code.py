"""Your own code, by name, in every process: reward functions today, tools and data transforms as they come.

A spec names a Python object in one of two ways:
    my_rewards:accuracy              a module and an attribute (also my_pkg.my_rewards.accuracy)
    path/to/my_rewards.py:accuracy   a file and an attribute

Modules and relative file paths are looked up in the folder you ran `launch.sh` from (GRPO_USER_DIR, which
launch.sh exports to every process it starts, on every host role), then in the checkout (so
`examples.byo.my_rewards:accuracy` works), then among the installed packages. Without GRPO_USER_DIR (a process
started by hand) the current folder stands in for it. The ranks, the genonly workers and the reward worker
processes each load a spec for themselves, the same way, so a spec that loads in one loads in all of them.

The folders are appended to sys.path, never put in front: a file of yours called `datasets.py` cannot shadow the
library; a name that an installed package already takes says so in the error.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from typing import Any

USER_DIR_ENV = "GRPO_USER_DIR"
CHECKOUT = Path(__file__).resolve().parent.parent


def user_dir() -> Path:
    """The folder the user ran launch.sh from (GRPO_USER_DIR), else this process's working folder."""
    return Path(os.environ.get(USER_DIR_ENV) or os.getcwd()).resolve()


def search_dirs() -> list[Path]:
    return list(dict.fromkeys([user_dir(), CHECKOUT]))


def _on_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.append(str(folder))


def split_spec(spec: str) -> tuple[str, str]:
    """'where:attr' or 'pkg.mod.attr' -> (where, attr); ValueError when it names no attribute."""
    where, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not where or not attr or not attr.isidentifier():
        raise ValueError(f"{spec!r} names no object: write 'module:name' or 'path/to/file.py:name'")
    return where, attr


def _load_file(path_text: str, spec: str):
    path = Path(path_text)
    if not path.is_absolute():
        path = user_dir() / path
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"{spec!r}: no file {path} (relative paths start from {user_dir()}, "
                         f"the folder launch.sh ran in)")
    name = f"grpo_user_file_{zlib.crc32(str(path).encode()):08x}_{path.stem}"  # one module per file, per process
    if name in sys.modules:
        return sys.modules[name]
    _on_path(path.parent)  # the file's own imports of its neighbours
    mod_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _load_module(mod_name: str, spec: str):
    for folder in search_dirs():
        _on_path(folder)
    try:
        return importlib.import_module(mod_name)
    except ImportError as e:
        where = ", ".join(str(d) for d in search_dirs())
        raise ValueError(f"{spec!r}: cannot import module {mod_name!r} ({e}); looked in {where} and the installed "
                         f"packages (run launch.sh from the folder that holds it, or give 'path/to/file.py:name')"
                         ) from e
    except Exception as e:  # the module itself raised while importing: name it, in one line
        raise ValueError(f"{spec!r}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e


def load_object(spec: str, kind: str = "function") -> Any:
    """The object `spec` names (see the module docstring); ValueError, in one line, when it cannot be had.
    kind "function": it must be callable (a class is callable too)."""
    spec = spec.strip()
    where, attr = split_spec(spec)
    module = _load_file(where, spec) if where.endswith(".py") else _load_module(where, spec)
    obj = getattr(module, attr, None)
    if obj is None or (kind == "function" and not callable(obj)):
        origin = getattr(module, "__file__", None) or "?"
        raise ValueError(f"{spec!r}: {origin} has no {'callable ' if kind == 'function' else ''}{attr!r}")
    return obj
