"""The argument parser of every entry point: what a user types is read the same way everywhere.

    from common.settings.argparser import ArgumentParser
    p = ArgumentParser(prog="python -m trainer.evaluate")

- Dashes and underscores are the same in an option's name: --max-new-tokens = --max_new_tokens (and
  --max-new-tokens=64); values are never touched, nor anything after a bare `--`.
- No prefix abbreviation: --num_generation is not --num_generations (argparse's allow_abbrev is off), it is
  an unknown option, and the error names the close one.
- An error is one line on stderr (`PROG: error: ...`, exit 2), not argparse's usage block: the trainer's
  usage alone lists well over a hundred options.
"""
from __future__ import annotations

import argparse
import difflib
import sys


def canonical(option: str) -> str:
    """--max-new-tokens and --max_new_tokens -> --max_new_tokens (only the name after the leading --)."""
    return "--" + option[2:].replace("-", "_")


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _long_options(self) -> dict[str, str]:
        """canonical spelling -> the spelling this parser declares, for every --option."""
        return {canonical(o): o for o in self._option_string_actions if o.startswith("--")}

    def normalize(self, args: list[str]) -> list[str]:
        """Each --option typed with the other separator becomes the declared spelling."""
        known, out = self._long_options(), []
        for i, a in enumerate(args):
            if a == "--":  # everything after it is an argument, never an option
                return out + args[i:]
            if a.startswith("--") and len(a) > 2:
                name, eq, value = a.partition("=")
                if name not in self._option_string_actions and canonical(name) in known:
                    a = known[canonical(name)] + eq + value
            out.append(a)
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self.normalize(args), namespace)

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(self.unknown_message(rest))
        return ns

    def unknown_message(self, rest: list[str]) -> str:
        """`unknown option --num_generation (did you mean --num_generations?)`, naming each unknown option."""
        known = self._long_options()
        parts = []
        for a in rest:
            if not a.startswith("-") or a == "--":
                continue
            name = a.partition("=")[0]
            close = difflib.get_close_matches(canonical(name), list(known), n=1, cutoff=0.75)
            parts.append(f"unknown option {name}" + (f" (did you mean {known[close[0]]}?)" if close else ""))
        if not parts:
            return f"unexpected argument(s): {' '.join(rest)}"
        return "; ".join(parts)

    def error(self, message: str):
        """One line, then exit 2 (argparse prints the whole usage first)."""
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
