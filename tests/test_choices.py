"""The multi-valued knobs (issue 64): their words are their types (common/settings/choices.py), parsed once by
common.settings.knobs.parse_choices in validate(), for a config from code, a file or the command line."""
from __future__ import annotations

import dataclasses
import json

import pytest

from common.config import GRPOConfig
from common.settings.knobs import build_parser, load_config


def write(tmp_path, obj, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def _typed_knobs(cls):
    import typing

    from common.settings.knobs import _base_type, _is_choice, _words
    hints = typing.get_type_hints(cls)
    choices = {f.name: _words(hints[f.name]) for f in dataclasses.fields(cls) if _is_choice(hints[f.name])}
    tri = [f.name for f in dataclasses.fields(cls)
           if not _is_choice(hints[f.name]) and _base_type(hints[f.name]) is bool and _words(hints[f.name])]
    return choices, tri


def test_multi_valued_knobs_are_parsed_once_from_their_types():
    """Issue 64: a choice knob's words live in its type (common/settings/choices.py); validate() parses every one,
    so a config built in code, read from a file or from the command line is checked the same way."""
    choices, tri = _typed_knobs(GRPOConfig)
    assert {"advantage_mode", "aggregation", "lr_schedule", "gen_backend", "vllm_dtype", "worker_dtype",
            "prompt_format", "old_logps", "vllm_importance_sampling_mode", "importance_sampling_level",
            "save_strategy"} <= set(choices)
    assert {"padding_free", "bf16", "vllm_eager"} <= set(tri)
    for name, words in choices.items():
        for word in words:
            assert getattr(GRPOConfig(**{name: word}).validate(), name) == word
        with pytest.raises(ValueError, match=f"unknown {name} 'nope'; use {words[0]}(, | or )"):
            GRPOConfig(**{name: "nope"}).validate()
        with pytest.raises(ValueError, match=f"unknown {name} 'nope'"):
            load_config(GRPOConfig, [f"--{name}", "nope"])
    for name in tri:  # true / false (booleans or the strings configs wrote) or auto, left a bool or "auto"
        assert getattr(GRPOConfig(**{name: "TRUE"}).validate(), name) is True
        assert getattr(GRPOConfig(**{name: "false"}).validate(), name) is False
        assert getattr(GRPOConfig(**{name: "auto"}).validate(), name) == "auto"
        with pytest.raises(ValueError, match=f"{name} must be true, false or auto, got 'maybe'"):
            GRPOConfig(**{name: "maybe"}).validate()
    text = build_parser(GRPOConfig).format_help()
    assert "--gen_backend hf|vllm|auto" in text and "--padding_free BOOL|auto" in text


def test_padding_free_takes_trls_boolean_in_a_file(tmp_path):
    """TRL's padding_free is a bool: `"padding_free": true` in a JSON config was refused while the knob was a string;
    the string form that configs wrote then still loads."""
    from ref_server.config import ServerConfig
    for value, parsed in ((True, True), (False, False), ("true", True), ("auto", "auto")):
        path = write(tmp_path, {"padding_free": value})
        assert load_config(GRPOConfig, ["--config", path]).padding_free == parsed
        assert load_config(ServerConfig, ["--model", "tiny", "--config", path]).padding_free == parsed
    with pytest.raises(ValueError, match="padding_free"):
        load_config(GRPOConfig, ["--config", write(tmp_path, {"padding_free": 1})])
    _, tri = _typed_knobs(ServerConfig)
    assert tri == ["padding_free"]
