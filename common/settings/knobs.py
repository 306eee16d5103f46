"""Config dataclasses' machinery: documented fields (`knob`), a JSON file overridden by CLI flags, --help.

    cfg = load_config(GRPOConfig, ["--config", "configs/demo.json", "--lr", "1e-4"])

Defaults <- JSON file (--config) <- CLI flags; an unknown key or a value of the wrong type is an error.
Flags take dashes or underscores and are never abbreviated (common/settings/argparser.py); entry points use
load_config_or_exit (one line, exit 2, on any config error). --help groups the fields by the class's
HELP_SECTIONS. A class with `ACCEPTS_TRL_NAMES = True` (GRPOConfig) also takes TRL's names
(common/settings/trl_aliases.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import os
import sys
import textwrap
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

from common.settings import trl_aliases
from common.settings.argparser import ArgumentParser

T = TypeVar("T")


def knob(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with documentation attached (shown by --help)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _base_type(tp: Any) -> Any:
    """Optional[X] -> X; X | Literal["auto"] -> X; Literal["a", "b"] (a choice) -> str; list -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None) and typing.get_origin(a) is not typing.Literal]
        return args[0] if args else str
    if origin is typing.Literal:
        return str
    return origin or tp


def _words(tp: Any) -> tuple[str, ...]:
    """The literal words a field takes besides its type: X | Literal["auto"] -> ("auto",); a choice's words."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return tuple(w for a in typing.get_args(tp) if typing.get_origin(a) is typing.Literal for w in typing.get_args(a))


def _is_choice(tp: Any) -> bool:
    """Literal["a", "b"] (or Optional of it): a string knob that takes only these words."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else [tp]
    return all(typing.get_origin(a) is typing.Literal for a in args)


def _or(words: tuple[str, ...]) -> str:
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def parse_choices(cfg: Any) -> list[str]:
    """Parse a config's multi-valued knobs once, from their types (issue 64): a choice (Literal["a", "b"]) must be
    one of its words; a tri-state (bool | Literal["auto"]) takes true / false as booleans or strings ("true", as
    configs wrote padding_free before it was typed) and is left a bool or the word. Rewrites the values in place;
    returns one message per bad value. Runs in the class's validate(), so a config built in code is parsed as one
    read from a file or the command line."""
    errors = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, value = hints[f.name], getattr(cfg, f.name)
        words = _words(tp)
        if not words or (value is None and type(None) in typing.get_args(tp)):
            continue
        if _is_choice(tp):
            if value not in words:
                errors.append(f"unknown {f.name} {value!r}; use {_or(words)}")
        elif _base_type(tp) is bool and not isinstance(value, bool):
            text = str(value).strip().lower()
            if text in words:
                setattr(cfg, f.name, text)
            elif text in ("true", "false"):
                setattr(cfg, f.name, text == "true")
            else:
                errors.append(f"{f.name} must be {_or(('true', 'false', *words))}, got {value!r}")
    return errors


def parse_bool(s: str) -> bool:
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


def parse_dict(s: str) -> dict:
    try:
        value = json.loads(s)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"key\": 1}}', got {s!r}")
    return value


def _converter(tp: Any, optional: bool):
    base = _base_type(tp)
    conv = {bool: parse_bool, int: int, float: float, str: str, list: _parse_list, dict: parse_dict}[base]
    words = _words(tp)
    if words:  # e.g. --Q_batch_size auto: resolved later (common/settings/gen_defaults.py)
        typed = conv

        def conv(s: str) -> Any:
            return s.strip().lower() if s.strip().lower() in words else typed(s)
        conv.__name__ = f"{base.__name__} or {' or '.join(words)}"  # argparse's "invalid ... value" names it
    if optional:
        return lambda s: None if s.strip().lower() in ("none", "null") else conv(s)
    return conv


def _description(cls: type) -> str | None:
    """The class docstring; None for a dataclass without one (its __doc__ is then the generated signature)."""
    doc = cls.__doc__ or ""
    return None if not doc.strip() or doc.startswith(cls.__name__ + "(") else inspect.cleandoc(doc)


def _sections(cls: type) -> list[tuple[str, str, list[str]]]:
    """--help groups: the class's HELP_SECTIONS [(title, description, field names)], then any field none of them
    names under 'other settings' (so a field is never missing from --help; tests keep that group empty)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if not hasattr(cls, "HELP_SECTIONS"):
        return [("", "", names)]  # one list, with --help and --config
    sections = [(t, d, [n for n in fs if n in names]) for t, d, fs in cls.HELP_SECTIONS]
    placed = {n for _, _, fs in sections for n in fs}
    rest = [n for n in names if n not in placed]
    return sections + ([("other settings", "", rest)] if rest else [])


def build_parser(cls: type, prog: str | None = None, description: str | None = None,
                 epilog: str | None = None) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=description or _description(cls), epilog=epilog,
                       usage="%(prog)s [--config FILE] [--OPTION VALUE ...]",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="JSON file with any of the options below, by name (flags "
                                                    "override it). Option names take dashes or underscores.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for title, text, names in _sections(cls):
        g = p.add_argument_group(title, text or None) if title else p
        for name in names:
            f = fields[name]
            tp = hints[f.name]
            optional = type(None) in typing.get_args(tp)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            g.add_argument(f"--{f.name}", dest=f.name, type=_converter(tp, optional), default=argparse.SUPPRESS,
                           metavar="|".join(_words(tp) if _is_choice(tp) else (_base_type(tp).__name__.upper(),
                                                                                  *_words(tp))),
                           help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"))
    if _has_aliases(cls):
        text = ("TRL's names, mapped to ours (common/settings/trl_aliases.py; docs/trl.md); giving both names of one "
                "knob is an error. Refused by name: " + ", ".join(sorted(trl_aliases.REFUSED)) + ".")
        g = p.add_argument_group("TRL GRPOConfig aliases", textwrap.fill(text, 100))  # (a raw-text formatter)
        for alias, (target, conv, hint) in trl_aliases.ALIASES.items():
            tp = hints[target]
            typ = str if conv is not None else _converter(tp, type(None) in typing.get_args(tp))
            g.add_argument(f"--{alias}", dest=alias, type=typ, default=argparse.SUPPRESS, metavar="VALUE",
                           help=f"-> {target}: {hint}".replace("%", "%%"))
        for name in sorted(set(trl_aliases.REFUSED) - set(fields)):  # refused with the file's reason, not "unknown"
            p.add_argument(f"--{name}", dest=name, type=trl_aliases.cli_value, default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
    return p


def _has_aliases(cls: type) -> bool:
    return bool(getattr(cls, "ACCEPTS_TRL_NAMES", False))


def _check_value(name: str, tp: Any, value: Any, source: str) -> Any:
    """A JSON value must have the field's type (an int is fine for a float); anything else is an error."""
    optional = type(None) in typing.get_args(tp)
    if value is None and optional:
        return None
    if isinstance(value, str) and value in _words(tp):
        return value
    base = _base_type(tp)
    if base is bool and _words(tp) and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"  # a tri-state written "true" (padding_free was a string knob)
    if isinstance(value, dict) and dict in typing.get_args(tp):  # str | dict | None: environment_factory's object
        return value
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is list and isinstance(value, str):  # "report_to": "wandb", "reward_fns": "correct,format": as on the CLI
        return [v.strip() for v in value.split(",") if v.strip()]
    if base in (bool, int, float, str, list, dict):
        ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
        if not ok:
            want = (" or ".join(repr(w) for w in _words(tp)) if _is_choice(tp) else
                    base.__name__ + "".join(f" or {w!r}" for w in _words(tp))) + (" or null" if optional else "")
            raise ValueError(f"{source}: field {name!r} must be {want}, got {value!r} ({type(value).__name__})")
    return value


def from_dict(cls: type[T], values: dict, source: str = "config") -> T:
    if _has_aliases(cls):
        values = trl_aliases.resolve_for(cls, values, source)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        known = sorted(names | (set(trl_aliases.ALIASES) if _has_aliases(cls) else set()))
        close = {u: difflib.get_close_matches(u.replace("-", "_"), known, n=1, cutoff=0.75) for u in unknown}
        hint = "; ".join(f"{u!r}: did you mean {c[0]!r}?" for u, c in close.items() if c)
        raise ValueError(f"{source}: unknown field(s) {unknown}" + (f" ({hint})" if hint else "")
                         + "; see --help for the valid ones")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _check_value(k, hints[k], v, source) for k, v in values.items()})


def load_config(cls: type[T], argv: list[str] | None = None, prog: str | None = None,
                ignore_unknown: tuple[str, ...] = (), description: str | None = None,
                epilog: str | None = None) -> T:
    """Defaults <- JSON file (--config) <- CLI flags. Unknown keys are errors, not ignored.
    description/epilog: --help's text above and below the options (default: the class docstring above).
    Started by launch.sh (GRPO_HELP_PROG, e.g. "launch.sh train --"), a GRPOConfig error names the user's command."""
    prog = _prog(cls, prog)
    parser = build_parser(cls, prog=prog, description=description, epilog=epilog)
    for name in ignore_unknown:  # e.g. --local_rank injected by the deepspeed launcher
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ns = vars(parser.parse_args(argv))
    for name in ignore_unknown:
        ns.pop(name, None)
    values: dict = {}
    file_values: dict = {}
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
    if _has_aliases(cls):  # the CLI's warmup_steps overrides the file's warmup_ratio, and so on
        values = trl_aliases.merge(values, trl_aliases.resolve_for(cls, ns, "command line", frozenset(file_values)))
    else:
        values.update(ns)
    try:
        cfg = from_dict(cls, values, source=str(cfg_file or "command line"))
        validate = getattr(cfg, "validate", None)
        return validate() if validate else cfg
    except ValueError as e:
        if not _has_aliases(cls):
            raise
        names = {f.name for f in dataclasses.fields(cls)}  # a knob given under its TRL name is named so (issue 64)
        raise ValueError(trl_aliases.as_written(str(e), set(file_values) | set(ns), names)) from None


def _prog(cls: type, prog: str | None) -> str | None:
    """The command an error names: launch.sh's (GRPO_HELP_PROG) for a GRPOConfig it started, else `prog`."""
    return os.environ.get("GRPO_HELP_PROG") or prog if _has_aliases(cls) else prog


def load_config_or_exit(cls: type[T], argv: list[str] | None = None, prog: str | None = None, **kw: Any) -> T:
    """load_config for an entry point: a bad value, an unknown key in the file or a failed validation is one
    line on stderr and exit 2, not a traceback (flag errors already are: common/settings/argparser.py)."""
    try:
        return load_config(cls, argv, prog=prog, **kw)
    except (ValueError, FileNotFoundError) as e:
        prog = _prog(cls, prog) or sys.argv[0]
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
