"""common.config: defaults, JSON file + CLI layering, parsing of every field type, errors, --help."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from common.config import GRPOConfig
from common.settings.knobs import build_parser, from_dict, knob, load_config, to_dict


def write(tmp_path, obj, name="cfg.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_defaults_match_simple_grpo():
    c = GRPOConfig()
    assert c.beta == 0.04
    assert (c.eps_low, c.eps_high) == (0.2, 0.2)
    assert c.num_pre_Q == 8
    assert c.temperature == 0.9
    assert c.max_new_tokens == 512
    assert c.lr == 1e-6
    assert c.all_steps == 1000
    assert c.save_steps == 200
    assert c.compute_gen_logps is True
    assert load_config(GRPOConfig, []) == c  # no file, no flags: the defaults, validated


def test_mutable_defaults_are_not_shared():
    a, b = GRPOConfig(), GRPOConfig()
    a.report_to.append("x")
    assert b.report_to == ["tensorboard"]
    assert a.reward_fns is None and a.reward_specs() == ["correct", "format"]  # null: the built-ins (no environment)


def test_every_field_has_help():
    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata.get("help", "").strip(), f"field {f.name} has no help"


def test_json_file_loading(tmp_path):
    path = write(tmp_path, {"lr": 3e-5, "num_pre_Q": 4, "compute_gen_logps": False, "reward_fns": ["correct"],
                            "data_limit": 100, "ref_token": None, "beta": 0, "output_dir": "runs/x"})
    c = load_config(GRPOConfig, ["--config", path])
    assert c.lr == 3e-5 and c.num_pre_Q == 4 and c.compute_gen_logps is False
    assert c.reward_fns == ["correct"] and c.data_limit == 100 and c.ref_token is None
    assert c.beta == 0.0 and isinstance(c.beta, float)  # an int in JSON is fine for a float field
    assert c.output_dir == "runs/x"
    assert c.temperature == 0.9  # untouched fields keep their defaults


def test_cli_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, {"lr": 3e-5, "num_pre_Q": 4, "beta": 0.1, "reward_fns": ["correct"]})
    c = load_config(GRPOConfig, ["--lr", "1e-4", "--config", path, "--reward_fns", "format,contains"])
    assert c.lr == 1e-4 and c.reward_fns == ["format", "contains"]  # flags win, wherever --config sits
    assert c.num_pre_Q == 4 and c.beta == 0.1                      # file wins over defaults


@pytest.mark.parametrize("flag,value,field,expected", [
    ("--compute_gen_logps", "false", "compute_gen_logps", False),
    ("--compute_gen_logps", "False", "compute_gen_logps", False),
    ("--compute_gen_logps", "0", "compute_gen_logps", False),
    ("--compute_gen_logps", "no", "compute_gen_logps", False),
    ("--compute_gen_logps", "off", "compute_gen_logps", False),
    ("--mask_truncated", "true", "mask_truncated", True),
    ("--mask_truncated", "1", "mask_truncated", True),
    ("--mask_truncated", "YES", "mask_truncated", True),
    ("--mask_truncated", "on", "mask_truncated", True),
    ("--num_pre_Q", "16", "num_pre_Q", 16),
    ("--all_steps", "0", "all_steps", 0),
    ("--lr", "5e-7", "lr", 5e-7),
    ("--temperature", "1", "temperature", 1.0),
    ("--reward_fns", "correct, format ,contains", "reward_fns", ["correct", "format", "contains"]),
    ("--reward_fns", '["a.b:c", "format"]', "reward_fns", ["a.b:c", "format"]),
    ("--reward_fns", "null", "reward_fns", None),
    ("--data_limit", "50", "data_limit", 50),
    ("--data_limit", "none", "data_limit", None),
    ("--data_limit", "null", "data_limit", None),
    ("--zero_stage", "3", "zero_stage", 3),
    ("--bf16", "true", "bf16", True),
    ("--bf16", "null", "bf16", None),
    ("--ref_token", "s3cret", "ref_token", "s3cret"),
    ("--ref_token", "None", "ref_token", None),
    ("--system_prompt", "", "system_prompt", ""),
    ("--eval_max_new_tokens", "64", "eval_max_new_tokens", 64),
    ("--model", "Qwen/Qwen2.5-0.5B", "model", "Qwen/Qwen2.5-0.5B"),
])
def test_cli_parsing_of_each_type(flag, value, field, expected):
    c = load_config(GRPOConfig, [flag, value])
    got = getattr(c, field)
    assert got == expected and type(got) is type(expected)


def test_cli_equals_syntax():
    c = load_config(GRPOConfig, ["--lr=2e-6", "--compute_gen_logps=false"])
    assert c.lr == 2e-6 and c.compute_gen_logps is False


@pytest.mark.parametrize("argv", [["--num_pre_Q", "eight"], ["--num_pre_Q", "2.5"], ["--lr", "fast"],
                                  ["--compute_gen_logps", "maybe"], ["--reward_fns", "[not json"],
                                  ["--data_limit", "lots"], ["--num_pre_Q"]])
def test_bad_cli_values_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        load_config(GRPOConfig, argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err  # argparse names the flag


def test_unknown_cli_flag_exits(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(GRPOConfig, ["--no_such_flag", "1e-4"])  # (--learning_rate is now TRL's alias of --lr)
    assert e.value.code == 2
    assert "--no_such_flag" in capsys.readouterr().err


def test_ignore_unknown_drops_launcher_flags():
    c = load_config(GRPOConfig, ["--local_rank", "3", "--lr", "1e-5"], ignore_unknown=("local_rank",))
    assert c.lr == 1e-5 and not hasattr(c, "local_rank")


def test_unknown_key_in_file_is_an_error_naming_it(tmp_path):
    # (TRL's learning_rate/num_generations are aliases now: tests/test_trl_aliases.py)
    path = write(tmp_path, {"lr": 1e-5, "learnin_rate": 1e-4, "num_generation": 8})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['learnin_rate', 'num_generation'\]") as e:
        load_config(GRPOConfig, ["--config", path])
    assert path in str(e.value)


def test_a_string_in_a_list_field_is_its_comma_separated_list(tmp_path):
    """TRL configs write "report_to": "wandb"; the command line takes "correct,format" the same way."""
    path = write(tmp_path, {"report_to": "wandb", "reward_fns": "correct, format"})
    cfg = load_config(GRPOConfig, ["--config", path])
    assert cfg.report_to == ["wandb"] and cfg.reward_fns == ["correct", "format"]


@pytest.mark.parametrize("values,match", [
    ({"lr": "1e-4"}, "field 'lr' must be float"),
    ({"num_pre_Q": 8.5}, "field 'num_pre_Q' must be int"),
    ({"num_pre_Q": True}, "field 'num_pre_Q' must be int"),
    ({"compute_gen_logps": "false"}, "field 'compute_gen_logps' must be bool"),
    ({"compute_gen_logps": 0}, "field 'compute_gen_logps' must be bool"),
    ({"reward_fns": 3}, "field 'reward_fns' must be list"),
    ({"data_limit": "100"}, "field 'data_limit' must be int or null"),
    ({"model": None}, "field 'model' must be str"),
])
def test_wrong_types_in_file_are_errors(tmp_path, values, match):
    path = write(tmp_path, values)
    with pytest.raises(ValueError, match=match):
        load_config(GRPOConfig, ["--config", path])


def test_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(GRPOConfig, ["--config", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(GRPOConfig, ["--config", write(tmp_path, "{lr: 1}")])


@pytest.mark.parametrize("field,value,match", [
    ("num_pre_Q", 1, "num_pre_Q must be >= 2"),
    ("Q_batch_size", 0, "Q_batch_size must be >= 1"),
    ("advantage_mode", "zscore", "unknown advantage_mode 'zscore'"),
    ("aggregation", "sum", "unknown aggregation 'sum'"),
    ("lr_schedule", "step", "unknown lr_schedule 'step'"),
    ("beta", -0.1, "beta must be >= 0"),
    ("eps_low", 1.0, "eps_low in"),
    ("eps_low", -0.1, "eps_low in"),
    ("eps_high", -0.2, "eps_high >= 0"),
    ("mu", 0, "mu must be >= 1"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ("temperature", 0.0, "temperature must be > 0"),
    ("zero_stage", 4, "zero_stage must be 0..3"),
])
def test_validate_errors(field, value, match):
    c = GRPOConfig(**{field: value})
    with pytest.raises(ValueError, match=match):
        c.validate()
    with pytest.raises(ValueError, match=match):  # load_config validates too
        load_config(GRPOConfig, [f"--{field}", str(value)])


def test_validate_accepts_edges():
    GRPOConfig(beta=0.0, eps_low=0.0, eps_high=0.0, num_pre_Q=2, zero_stage=0, mu=1).validate()
    assert GRPOConfig().validate() is not None  # returns the config (chainable)


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)  # argparse re-wraps help text (even at hyphens)


def test_help_lists_every_field(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        load_config(GRPOConfig, ["--help"], prog="trainer/main.py")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trainer/main.py")
    flat = _squash(out)
    assert "--config" in out
    for f in dataclasses.fields(GRPOConfig):
        assert f"--{f.name}" in out, f.name
        assert _squash(f.metadata["help"]) in flat, f"help of {f.name} missing from --help"
    assert _squash("(default: 0.04)") in flat and _squash("(default: ['tensorboard'])") in flat


def test_help_survives_percent_signs(capsys):
    @dataclasses.dataclass
    class C:
        frac: float = knob(0.5, "Fraction of the data (50% = half).")

    with pytest.raises(SystemExit):
        build_parser(C).parse_args(["--help"])
    assert "50% = half" in capsys.readouterr().out


def test_to_dict_from_dict_round_trip(tmp_path):
    c = load_config(GRPOConfig, ["--lr", "2e-5", "--reward_fns", "a,b", "--data_limit", "7"])
    d = to_dict(c)
    assert json.loads(json.dumps(d)) == d  # JSON-able: can be written next to a run
    assert from_dict(GRPOConfig, d) == c
    assert load_config(GRPOConfig, ["--config", write(tmp_path, d)]) == c


# --- issue 31: the command line a user types ------------------------------------------------------------------
def test_dashes_and_underscores_are_one_option(tmp_path):
    a = load_config(GRPOConfig, ["--max-new-tokens", "64", "--num-pre-Q=4", "--reward-fns", "format",
                                 "--learning-rate", "3e-5", "--max_grad-norm", "0.5"])
    b = load_config(GRPOConfig, ["--max_new_tokens", "64", "--num_pre_Q=4", "--reward_fns", "format",
                                 "--learning_rate", "3e-5", "--max_grad_norm", "0.5"])
    assert a == b and (a.max_new_tokens, a.num_pre_Q, a.lr, a.grad_clip) == (64, 4, 3e-5, 0.5)
    # values are never rewritten, and launch.sh's --local-rank spelling is dropped like --local_rank
    c = load_config(GRPOConfig, ["--system-prompt=--keep-me--", "--local-rank", "1"], ignore_unknown=("local_rank",))
    assert c.system_prompt == "--keep-me--"


@pytest.mark.parametrize("argv, hint", [
    (["--num_generation", "4"], "unknown option --num_generation (did you mean --num_generations?)"),
    (["--num-generation", "4"], "unknown option --num-generation (did you mean --num_generations?)"),
    (["--max_new_token", "4"], "unknown option --max_new_token (did you mean --max_new_tokens?)"),
    (["--lr_sched", "cosine"], "unknown option --lr_sched"),
])
def test_no_prefix_abbreviation_and_one_line_naming_the_close_option(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        load_config(GRPOConfig, argv, prog="trainer/main.py")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainer/main.py: error: ") and hint in err, err


def test_unknown_key_in_a_file_suggests_the_close_name(tmp_path):
    with pytest.raises(ValueError, match=r"'num_generation': did you mean 'num_generations'\?"):
        load_config(GRPOConfig, ["--config", write(tmp_path, {"num_generation": 4})])


def test_help_is_grouped_by_section_with_a_description(capsys, monkeypatch):
    from common.settings.sections import SECTIONS

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        load_config(GRPOConfig, ["--help"], prog="trainer/main.py")
    out = capsys.readouterr().out
    assert "GRPOConfig(model: str" not in out  # not the dataclass signature
    assert out.splitlines()[2].startswith("Every option of the trainer ranks")
    assert len(out.splitlines()[0]) < 120  # the usage line does not list every option
    titles = [t for t, _, _ in SECTIONS]
    assert titles[:3] == ["model and data", "rewards", "generation"] and "health" in titles
    at = [out.index(f"\n{t}:\n") for t in titles]
    assert at == sorted(at)  # each section once, in order
    for title, _, names in SECTIONS:  # each field is listed in its own section
        start, end = out.index(f"\n{title}:\n"), min([i for i in at if i > out.index(f"\n{title}:\n")] or [len(out)])
        for name in names:
            assert f"  --{name} " in out[start:end], (title, name)


def test_every_field_has_a_section():
    from common.settings.sections import SECTIONS

    placed = [n for _, _, names in SECTIONS for n in names]
    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert sorted(placed) == sorted(fields), (set(fields) - set(placed), set(placed) - set(fields))


def test_trainer_main_errors_are_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    from conftest import REPO, subprocess_env

    bad_json = write(tmp_path, {"lr": 1e-5, "beta": "high"})
    cases = [(["--bad_key", "1"], "unknown option --bad_key"),
             (["--num-generation", "4"], "did you mean --num_generations?"),
             (["--beta", "-1"], "config: beta must be >= 0"),
             (["--config", bad_json], "field 'beta' must be float"),
             (["--config", write(tmp_path, {"lerning_rate": 1}, "b.json")],
              "'lerning_rate': did you mean 'learning_rate'?"),
             (["--config", str(tmp_path / "missing.json")], "config file not found"),
             (["genonly", "--lr_scheduler_type", "warmup_stable_decay"], "lr_scheduler_type='warmup_stable_decay'")]
    for argv, want in cases:
        r = subprocess.run([sys.executable, str(REPO / "trainer" / "main.py"), *argv], cwd=tmp_path,
                           env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and want in r.stderr, (argv, r.stderr)
        assert r.stderr.startswith("trainer/main.py: error: "), r.stderr


def test_trainer_help_says_which_option_a_position_means():
    import subprocess
    import sys

    from conftest import REPO, subprocess_env

    r = subprocess.run([sys.executable, str(REPO / "trainer" / "main.py"), "--help"], cwd=REPO,
                       env=subprocess_env(COLUMNS="120"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert "./launch.sh train [launch.sh options] -- [these options]" in r.stdout
    assert "./launch.sh train --config F" in r.stdout and "dashes or underscores" in r.stdout


def test_save_strategy_is_trls_steps_or_no():
    assert GRPOConfig().validate().save_strategy == "steps"
    assert load_config(GRPOConfig, ["--save_strategy", "no"]).save_strategy == "no"
    with pytest.raises(ValueError, match="save_strategy 'epoch'"):
        GRPOConfig(save_strategy="epoch").validate()

