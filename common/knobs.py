"""Config dataclasses' machinery: documented fields (`knob`), a JSON file overridden by CLI flags, --help.

    cfg = load_config(GRPOConfig, ["--config", "configs/demo.json", "--lr", "1e-4"])

Defaults <- JSON file (--config) <- CLI flags; an unknown key or a value of the wrong type is an error.
A class with `ACCEPTS_TRL_NAMES = True` (GRPOConfig) also takes TRL's names (common/trl_aliases.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

from common import trl_aliases

T = TypeVar("T")


def knob(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with documentation attached (shown by --help)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _base_type(tp: Any) -> Any:
    """Optional[X] -> X; list -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return origin or tp


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def _parse_list(s: str) -> list:
    s = s.strip()
    if s.startswith("["):
        return json.loads(s)
    return [p for p in (x.strip() for x in s.split(",")) if p]


def _converter(tp: Any, optional: bool):
    base = _base_type(tp)
    conv = {bool: _parse_bool, int: int, float: float, str: str, list: _parse_list}[base]
    if optional:
        return lambda s: None if s.strip().lower() in ("none", "null") else conv(s)
    return conv


def build_parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON file with any of the fields below (CLI flags override it).")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        p.add_argument(f"--{f.name}", dest=f.name, type=_converter(tp, optional), default=argparse.SUPPRESS,
                       help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"))
    if _has_aliases(cls):
        g = p.add_argument_group("TRL GRPOConfig aliases", "TRL's names, mapped to ours (common/trl_aliases.py); "
                                 "giving both names of one knob is an error. Refused by name: "
                                 + ", ".join(sorted(trl_aliases.REFUSED)) + ".")
        for alias, (target, conv, hint) in trl_aliases.ALIASES.items():
            tp = hints[target]
            typ = str if conv is not None else float if alias == "warmup_ratio" else \
                _converter(tp, type(None) in typing.get_args(tp))
            g.add_argument(f"--{alias}", dest=alias, type=typ, default=argparse.SUPPRESS,
                           help=f"-> {target}: {hint}".replace("%", "%%"))
    return p


def _has_aliases(cls: type) -> bool:
    return bool(getattr(cls, "ACCEPTS_TRL_NAMES", False))


def _check_value(name: str, tp: Any, value: Any, source: str) -> Any:
    """A JSON value must have the field's type (an int is fine for a float); anything else is an error."""
    optional = type(None) in typing.get_args(tp)
    if value is None and optional:
        return None
    base = _base_type(tp)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (bool, int, float, str, list, dict):
        ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
        if not ok:
            want = base.__name__ + (" or null" if optional else "")
            raise ValueError(f"{source}: field {name!r} must be {want}, got {value!r} ({type(value).__name__})")
    return value


def from_dict(cls: type[T], values: dict, source: str = "config") -> T:
    if _has_aliases(cls):
        values = trl_aliases.resolve_for(cls, values, source)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}; see --help for the valid ones")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _check_value(k, hints[k], v, source) for k, v in values.items()})


def load_config(cls: type[T], argv: list[str] | None = None, prog: str | None = None,
                ignore_unknown: tuple[str, ...] = ()) -> T:
    """Defaults <- JSON file (--config) <- CLI flags. Unknown keys are errors, not ignored."""
    parser = build_parser(cls, prog=prog)
    for name in ignore_unknown:  # e.g. --local_rank injected by the deepspeed launcher
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ns = vars(parser.parse_args(argv))
    for name in ignore_unknown:
        ns.pop(name, None)
    values: dict = {}
    cfg_file = ns.pop("config", None)
    if cfg_file:
        path = Path(cfg_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            file_values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from e
        if not isinstance(file_values, dict):
            raise ValueError(f"config file {path} must hold a JSON object")
        # Aliases are resolved per source: both names in one place is an error; the CLI overrides the file.
        values.update(trl_aliases.resolve_for(cls, file_values, str(path)) if _has_aliases(cls) else file_values)
    values.update(trl_aliases.resolve_for(cls, ns, "command line", values) if _has_aliases(cls) else ns)
    cfg = from_dict(cls, values, source=str(cfg_file or "command line"))
    validate = getattr(cfg, "validate", None)
    return validate() if validate else cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
