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


def resolve_model_path(path_or_id: str) -> str:
    """'tiny' names the embedded default (built once, then cached); anything else is passed through."""
    if path_or_id == "tiny":
        from common.tiny_model import ensure_tiny_model
        return str(ensure_tiny_model())
    check_model_path(path_or_id)
    return path_or_id


def local_model_dir(path_or_id: str, revision: str | None = None) -> Path:
    """The directory holding a model's files: a local path as is, a hub id ('Qwen/Qwen2.5-1.5B-Instruct')
    through the Hugging Face cache (HF_HOME / HF_HUB_CACHE), where from_pretrained put it. Never downloads:
    a process that reads checkpoint files (the LoRA base weights) runs after the model was loaded once."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if looks_local(path_or_id):
        raise FileNotFoundError(f"model path {path_or_id!r} does not exist")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path_or_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"model {path_or_id!r} is neither a local directory nor in the Hugging Face cache "
                                f"{constants.HF_HUB_CACHE}: load it once (from_pretrained downloads it) or pass a "
                                f"local directory") from e

