"""GRPOConfig of the Python API: TRL 1.16's keyword names (and ours), read by the same loader as the JSON config, so
the same table holds (docs/trl.md: honoured, honoured with another default, refused by name with the reason).

    args = GRPOConfig(output_dir="out", learning_rate=1e-6, num_generations=8, max_steps=100)
    args.learning_rate, args.num_pre_Q       # 1e-06, 8: a TRL name as given, or what our field holds

A bad value or a refused name raises ValueError at construction, in one line. What is given is what the run's
JSON config holds (trainer/api/trainer.py writes it): the loader then reads it as it reads any config file.
"""
from __future__ import annotations

import json
from typing import Any

from common.config import GRPOConfig as _Ours
from common.settings import trl_aliases
from common.settings.knobs import from_dict


def resolve(values: dict, source: str = "GRPOConfig") -> _Ours:
    """Our config from TRL / our names, validated; ValueError in one line."""
    try:
        return from_dict(_Ours, dict(values), source=source).validate()
    except (ValueError, TypeError) as e:
        raise ValueError(" ".join(str(e).split())) from None


def _plain(name: str, value: Any) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"GRPOConfig: {name}={value!r} is not a plain value (text, number, list, dict): the "
                         f"run's processes read it from a JSON file") from None


class GRPOConfig:
    """TRL's `GRPOConfig(output_dir=None, **kwargs)`: every keyword a TRL 1.16 GRPOConfig (or TrainingArguments) takes
    that this trainer honours, and every field of ours (common/config.py). Attributes read back what was given, or
    our field's value."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any) -> None:
        given = dict(kwargs)
        if output_dir is not None:
            given["output_dir"] = output_dir
        for name, value in given.items():
            _plain(name, value)
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_resolved", resolve(given))

    def to_dict(self) -> dict:
        """The keywords as given (TRL's names kept): the run's JSON config."""
        return dict(self._given)

    @property
    def resolved(self) -> _Ours:
        """Our config, every TRL name translated (common/config.py's GRPOConfig)."""
        return self._resolved

    def __getattr__(self, name: str) -> Any:
        given = self.__dict__["_given"]
        if name in given:
            return given[name]
        if name in trl_aliases.ALIASES:
            return getattr(self.__dict__["_resolved"], trl_aliases.ALIASES[name][0])
        try:
            return getattr(self.__dict__["_resolved"], name)
        except AttributeError:
            raise AttributeError(f"GRPOConfig has no field {name!r} (TRL's or ours)") from None

    def __setattr__(self, name: str, value: Any) -> None:
        """`args.learning_rate = 1e-5` after construction, checked as at construction."""
        _plain(name, value)
        given = {**self._given, name: value}
        object.__setattr__(self, "_resolved", resolve(given))
        object.__setattr__(self, "_given", given)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"
