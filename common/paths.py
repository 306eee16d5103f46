"""Model paths: tell a local path from a hub id without importing torch (the ref server checks before loading)."""
from __future__ import annotations

from pathlib import Path


def looks_local(path_or_id: str) -> bool:
    """A path, not a hub id: starts with / . ~, or has more than one '/' (hub ids are 'org/name')."""
    return path_or_id.startswith(("/", ".", "~")) or path_or_id.count("/") > 1


def check_model_path(path_or_id: str) -> None:
    """One clear line for a local-looking model path that does not exist (instead of a hub-lookup traceback)."""
    if looks_local(path_or_id) and not Path(path_or_id).expanduser().exists():
        raise FileNotFoundError(f"model path {path_or_id!r} does not exist")
