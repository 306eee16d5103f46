"""TRL GRPOConfig names as aliases (issue 13): every alias reaches the same field as our name, in the JSON file
and on the command line; unsupported names and values are refused by name; both names at once is an error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import GRPOConfig
from common.settings import trl_aliases
from common.settings.knobs import build_parser, from_dict, load_config

# alias, value given, our field, value it must reach
CASES = [
    ("num_generations", 4, "num_pre_Q", 4),
    ("max_completion_length", 64, "max_new_tokens", 64),
    ("max_prompt_length", 100, "max_prompt_length", 100),
    ("learning_rate", 3e-5, "lr", 3e-5),
    ("beta", 0.0, "beta", 0.0),
    ("epsilon_high", 0.28, "eps_high", 0.28),
    ("num_iterations", 2, "mu", 2),
    ("temperature", 0.7, "temperature", 0.7),
    ("top_p", 0.95, "top_p", 0.95),
    ("loss_type", "grpo", "aggregation", "seq_mean"),
    ("loss_type", "bnpo", "aggregation", "token_mean"),
    ("loss_type", "dr_grpo", "aggregation", "dr_grpo"),
    ("loss_type", "dapo", "aggregation", "dapo"),
    ("scale_rewards", "group", "advantage_mode", "grpo"),
    ("scale_rewards", "batch", "advantage_mode", "grpo_batch_std"),
    ("scale_rewards", "none", "advantage_mode", "grpo_no_std"),
    ("mask_truncated_completions", True, "mask_truncated", True),
    ("max_grad_norm", 0.5, "grad_clip", 0.5),
    ("lr_scheduler_type", "cosine", "lr_schedule", "cosine"),
    ("lr_scheduler_type", "constant_with_warmup", "lr_schedule", "constant"),
    ("save_steps", 50, "save_steps", 50),
    ("seed", 7, "seed", 7),
    ("max_steps", 30, "all_steps", 30),
    ("logging_steps", 5, "log_every", 5),
    ("lr_scheduler_type", "linear", "lr_schedule", "linear"),            # issue 31: refused before
    ("gradient_accumulation_steps", 4, "grad_accum", 4),                  # issue 31: refused before
    ("model_revision", "v1.0", "revision", "v1.0"),                      # TRL ModelConfig's name
    ("trust_remote_code", True, "trust_remote_code", True),               # TRL GRPOConfig's name, ours too
    ("attn_implementation", "eager", "attn_implementation", "eager"),
    ("vllm_max_model_length", 2048, "vllm_max_model_len", 2048),         # issue 40: unknown before
    ("resume_from_checkpoint", True, "resume", True),
    ("model_name_or_path", "some/model", "model", "some/model"),
]


@pytest.mark.parametrize("alias, value, field, want", CASES)
def test_alias_reaches_our_field_in_json_and_cli(tmp_path, alias, value, field, want):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({alias: value}))
    assert getattr(load_config(GRPOConfig, ["--config", str(path)]), field) == want
    assert getattr(from_dict(GRPOConfig, {alias: value}), field) == want
    assert getattr(load_config(GRPOConfig, [f"--{alias}", str(value)]), field) == want
    if alias != field:  # our own name gives the same result
        our = want if not isinstance(want, str) or field != "aggregation" else want
        assert getattr(load_config(GRPOConfig, [f"--{field}", str(our)]), field) == want


def test_epsilon_sets_both_clips_like_trl():
    c = load_config(GRPOConfig, ["--epsilon", "0.3"])
    assert c.eps_low == 0.3 and c.eps_high == 0.3
    c = load_config(GRPOConfig, ["--epsilon", "0.2", "--epsilon_high", "0.28"])
    assert (c.eps_low, c.eps_high) == (0.2, 0.28)


def test_warmup_ratio_uses_the_run_length(tmp_path):
    assert load_config(GRPOConfig, ["--warmup_ratio", "0.1", "--max_steps", "50"]).warmup_steps == 5
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"all_steps": 200, "mu": 2}))  # a step is one update whatever mu (issue 24)
    assert load_config(GRPOConfig, ["--config", str(path), "--warmup_ratio", "0.05"]).warmup_steps == 10


def test_warmup_ratio_uses_the_final_step_count_whichever_source_gave_which(tmp_path):
    """Issue 40: warmup_ratio in the file with --max_steps on the command line was converted against the default
    1000 steps (a 50-step run got warmup_steps 100)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"warmup_ratio": 0.1}))
    assert load_config(GRPOConfig, ["--config", str(path), "--max_steps", "50"]).warmup_steps == 5
    assert load_config(GRPOConfig, ["--config", str(path), "--all_steps", "30"]).warmup_steps == 3
    assert load_config(GRPOConfig, ["--config", str(path), "--warmup_steps", "7"]).warmup_steps == 7  # CLI wins
    path.write_text(json.dumps({"warmup_steps": 0, "max_steps": 40}))  # trl_defaults.json carries warmup_steps 0
    assert load_config(GRPOConfig, ["--config", str(path), "--warmup_ratio", "0.25"]).warmup_steps == 10
    with pytest.raises(ValueError, match="both warmup_ratio and warmup_steps"):
        load_config(GRPOConfig, ["--warmup_ratio", "0.1", "--warmup_steps", "3"])
    with pytest.raises(ValueError, match="warmup_ratio must be in"):
        load_config(GRPOConfig, ["--warmup_ratio", "1.5"])


def test_num_train_epochs_sets_all_steps_from_the_dataset_size(tmp_path):
    c = load_config(GRPOConfig, ["--num_train_epochs", "2", "--warmup_ratio", "0.1", "--grad_accum", "2"])
    c.resolve_epochs(prompts=100, world=2)  # a step takes 2 ranks x 2 batches x 1 group
    assert (c.all_steps, c.warmup_steps) == (50, 5)
    c = load_config(GRPOConfig, ["--num_train_epochs", "1", "--num_iterations", "2"])
    c.resolve_epochs(prompts=7, world=2)
    assert c.all_steps == 8  # ceil(7 / 2) rounds, 2 updates each
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_train_epochs": 3, "max_steps": 20}))  # as TRL: max_steps wins
    c = load_config(GRPOConfig, ["--config", str(path)])
    assert c.num_train_epochs is None and c.all_steps == 20
    c.resolve_epochs(prompts=1000, world=1)
    assert c.all_steps == 20
    path.write_text(json.dumps({"num_train_epochs": 3, "max_steps": -1}))  # TRL's -1: the epochs decide
    assert load_config(GRPOConfig, ["--config", str(path)]).num_train_epochs == 3


def test_epsilon_applies_at_the_sequence_level_like_trl():
    """Issue 40: TRL clips GSPO's sequence ratio with epsilon/epsilon_high; ours ignored them there."""
    c = load_config(GRPOConfig, ["--importance_sampling_level", "sequence", "--epsilon", "3e-4",
                                 "--epsilon_high", "4e-4"])
    assert (c.gspo_eps_low, c.gspo_eps_high) == (3e-4, 4e-4)
    c = load_config(GRPOConfig, ["--importance_sampling_level", "sequence", "--epsilon", "0.01"])
    assert (c.gspo_eps_low, c.gspo_eps_high) == (0.01, 0.01)
    c = load_config(GRPOConfig, ["--importance_sampling_level", "sequence"])  # neither given: GSPO's defaults
    assert (c.gspo_eps_low, c.gspo_eps_high) == (3e-4, 4e-4)
    with pytest.raises(ValueError, match="'epsilon'.*'gspo_eps_low'"):
        load_config(GRPOConfig, ["--epsilon", "0.1", "--gspo_eps_low", "0.2"])
    from trainer.objective.update import _eps
    assert _eps(load_config(GRPOConfig, ["--importance_sampling_level", "sequence", "--epsilon", "0.01"])) == \
        {"eps_low": 0.01, "eps_high": 0.01}


def test_trl_importance_sampling_names():
    c = load_config(GRPOConfig, ["--vllm_importance_sampling_mode", "token_mask",
                                 "--vllm_importance_sampling_cap", "2.5"])  # TRL's deprecated name of clip_max
    assert (c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_max) == ("token_mask", 2.5)


def test_both_names_for_one_knob_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="'learning_rate'.*'lr'"):
        load_config(GRPOConfig, ["--learning_rate", "1e-5", "--lr", "1e-4"])
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_generations": 4, "num_pre_Q": 8}))
    with pytest.raises(ValueError, match="'num_generations'.*'num_pre_Q'"):
        load_config(GRPOConfig, ["--config", str(path)])


def test_vllm_tensor_parallel_size_is_ours_too(tmp_path):
    """TRL's vllm_tensor_parallel_size (GPUs per vLLM worker) is a field of ours (issue 30; refused before)."""
    assert load_config(GRPOConfig, ["--vllm_tensor_parallel_size", "2"]).vllm_tensor_parallel_size == 2
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"vllm_tensor_parallel_size": 4}))
    assert load_config(GRPOConfig, ["--config", str(path)]).vllm_tensor_parallel_size == 4
    assert GRPOConfig().vllm_tensor_parallel_size == 1 and "vllm_tensor_parallel_size" not in trl_aliases.REFUSED
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size must be >= 1"):
        load_config(GRPOConfig, ["--vllm_tensor_parallel_size", "0"])


@pytest.mark.parametrize("name, value", [("push_to_hub", True), ("cache_implementation", "static"),
                                         ("remove_unused_columns", True),
                                         ("generation_batch_size", 16), ("sync_ref_model", True),
                                         ("vllm_mode", "colocate"), ("log_unique_prompts", True)])
def test_unsupported_trl_names_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"cannot honour.*'{name}'={value!r} \\("):
        from_dict(GRPOConfig, {name: value})


@pytest.mark.parametrize("name", ["push_to_hub", "vllm_mode", "sync_ref_model"])
def test_command_line_gives_the_files_reason(tmp_path, name):
    """Issue 40: `--push_to_hub true` was a bare 'unknown option'; now the same reason as in the JSON file."""
    value = {"push_to_hub": True, "vllm_mode": "colocate", "sync_ref_model": True}[name]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({name: value}))
    with pytest.raises(ValueError) as in_file:
        load_config(GRPOConfig, ["--config", str(path)])
    with pytest.raises(ValueError) as on_cli:
        load_config(GRPOConfig, [f"--{name}", json.dumps(value).strip('"')])
    reason = trl_aliases.REFUSED[name]
    assert reason in str(in_file.value) and reason in str(on_cli.value)
    assert str(in_file.value).split(": ", 1)[1] == str(on_cli.value).split(": ", 1)[1]


@pytest.mark.parametrize("name, value", [("remove_unused_columns", False), ("shuffle_dataset", True),
                                         ("push_to_hub", False), ("ds3_gather_for_generation", True),
                                         ("sync_ref_model", False), ("fp16", False), ("delta", None)])
def test_refused_name_with_the_value_we_do_anyway_is_accepted(tmp_path, name, value):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({name: value}))
    assert load_config(GRPOConfig, ["--config", str(path)]) == GRPOConfig().validate()
    assert load_config(GRPOConfig, [f"--{name}", json.dumps(value)]) == GRPOConfig().validate()


def test_resume_from_checkpoint_path_is_refused_with_the_way():
    with pytest.raises(ValueError, match="resume_from_checkpoint='runs/x/step_5'.*output_dir"):
        from_dict(GRPOConfig, {"resume_from_checkpoint": "runs/x/step_5"})


def test_use_vllm_maps_to_gen_backend(tmp_path):
    assert load_config(GRPOConfig, ["--use_vllm", "true"]).gen_backend == "vllm"
    assert load_config(GRPOConfig, ["--use_vllm", "false"]).gen_backend == "hf"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"use_vllm": True}))
    assert load_config(GRPOConfig, ["--config", str(path)]).gen_backend == "vllm"
    with pytest.raises(ValueError, match="'use_vllm'.*'gen_backend'"):
        load_config(GRPOConfig, ["--use_vllm", "true", "--gen_backend", "hf"])
    with pytest.raises(ValueError, match="use_vllm='maybe'"):
        load_config(GRPOConfig, ["--use_vllm", "maybe"])


@pytest.mark.parametrize("alias, value", [("scale_rewards", "sometimes"),
                                          ("lr_scheduler_type", "cosine_with_restarts")])
def test_unsupported_values_are_refused_with_the_name(alias, value):
    with pytest.raises(ValueError, match=f"{alias}={value!r}"):
        from_dict(GRPOConfig, {alias: value})


def test_unknown_name_still_refused():
    with pytest.raises(ValueError, match="no_such_knob"):
        from_dict(GRPOConfig, {"no_such_knob": 1})


def test_help_lists_the_aliases():
    text = build_parser(GRPOConfig).format_help()
    for alias in trl_aliases.ALIASES:
        assert f"--{alias}" in text
    assert "Refused by name" in text and "use_vllm" in text


def test_new_data_and_reward_fields_validate():
    c = load_config(GRPOConfig, ["--prompt_format", "messages", "--reward_weights", "[1, 0.5]"])
    assert c.prompt_format == "messages" and c.reward_weights == [1, 0.5]
    with pytest.raises(ValueError, match="prompt_format"):
        load_config(GRPOConfig, ["--prompt_format", "jinja"])
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        load_config(GRPOConfig, ["--reward_weights", "[1]"])
    with pytest.raises(ValueError, match="system_prompt"):
        load_config(GRPOConfig, ["--prompt_format", "raw", "--system_prompt", "Be brief."])
    with pytest.raises(ValueError, match="reward_timeout"):
        load_config(GRPOConfig, ["--reward_timeout", "-1"])


# --- issue 31: TRL's defaults in one file, and the ones that differ from ours documented ---------------------------
def test_both_names_with_the_same_meaning_are_accepted(tmp_path):
    """Issue 60: `--use_vllm true --gen_backend vllm` says one thing twice: accepted; a real conflict is refused."""
    assert load_config(GRPOConfig, ["--use_vllm", "true", "--gen_backend", "vllm"]).gen_backend == "vllm"
    assert load_config(GRPOConfig, ["--learning_rate", "1e-5", "--lr", "1e-5"]).lr == 1e-5
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_generations": 4, "num_pre_Q": 4, "epsilon": 0.1, "gspo_eps_low": 0.1}))
    c = load_config(GRPOConfig, ["--config", str(path)])
    assert (c.num_pre_Q, c.eps_low, c.gspo_eps_low) == (4, 0.1, 0.1)
    with pytest.raises(ValueError, match="'use_vllm'.*'gen_backend'.*different values"):
        load_config(GRPOConfig, ["--use_vllm", "true", "--gen_backend", "hf"])


def test_reward_funcs_is_trls_name_of_reward_fns(tmp_path):
    """Issue 60: GRPOTrainer's `reward_funcs` (used in docs/trl.md's own table) was refused, 'did you mean'."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"reward_funcs": ["format", "correct"]}))
    assert load_config(GRPOConfig, ["--config", str(path)]).reward_fns == ["format", "correct"]
    assert load_config(GRPOConfig, ["--reward_funcs", "format"]).reward_fns == ["format"]
    with pytest.raises(ValueError, match="'reward_funcs'.*'reward_fns'"):
        load_config(GRPOConfig, ["--reward_funcs", "format", "--reward_fns", "correct"])


def test_command_line_epsilon_keeps_the_files_epsilon_high(tmp_path):
    """Issue 60: TRL's epsilon_high defaults to epsilon only where no source gave it; a CLI --epsilon used to
    overwrite the file's explicit epsilon_high (and its sequence clip)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"epsilon_high": 0.28}))
    c = load_config(GRPOConfig, ["--config", str(path), "--epsilon", "0.1"])
    assert (c.eps_low, c.eps_high, c.gspo_eps_low, c.gspo_eps_high) == (0.1, 0.28, 0.1, 0.28)
    path.write_text(json.dumps({"epsilon": 0.3}))  # the file's eps_high came from its epsilon: the CLI's wins
    c = load_config(GRPOConfig, ["--config", str(path), "--epsilon", "0.1"])
    assert (c.eps_low, c.eps_high, c.gspo_eps_high) == (0.1, 0.1, 0.1)


TRL_DEFAULTS = Path(__file__).resolve().parents[1] / "configs" / "trl_defaults.json"


def test_trl_defaults_file_is_a_config_we_accept():
    c = load_config(GRPOConfig, ["--config", str(TRL_DEFAULTS)])  # validates
    # TRL 1.16's GRPOConfig defaults (trl/trainer/grpo_config.py + TrainingArguments), read through our names
    assert (c.lr, c.lr_schedule, c.beta, c.temperature, c.max_new_tokens, c.num_pre_Q) == \
        (1e-6, "linear", 0.0, 1.0, 512, 8)
    assert (c.loss_type, c.aggregation, c.eps_low, c.eps_high, c.mu, c.advantage_mode) == \
        ("dapo", "dapo", 0.2, 0.2, 1, "grpo")
    assert (c.grad_accum, c.log_every, c.save_steps, c.gradient_checkpointing, c.bf16) == (1, 10, 500, True, True)
    assert c.train_zero_spread is True and GRPOConfig().train_zero_spread is False  # TRL trains every group (issue 60)


def test_every_default_that_differs_from_trl_is_in_the_docs_table():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    table = doc.split("## Defaults that differ from TRL 1.16")[1].split("\n\n")[2]
    trl, ours = load_config(GRPOConfig, ["--config", str(TRL_DEFAULTS)]), GRPOConfig()
    for name in json.loads(TRL_DEFAULTS.read_text()):
        field = trl_aliases.ALIASES.get(name, (name,))[0]
        if getattr(trl, field) != getattr(ours, field):
            assert f"| `{name}`" in table, f"TRL default of {name} differs from ours ({getattr(trl, field)!r} vs " \
                                          f"{getattr(ours, field)!r}) but docs/trl.md's table does not say so"


def test_gradient_accumulation_steps_says_how_it_differs_from_trl():
    hint = trl_aliases.ALIASES["gradient_accumulation_steps"][2]
    assert "steps_per_generation" in hint and "grad_accum" in hint
    assert "gradient_accumulation_steps" not in trl_aliases.REFUSED and "model_init_kwargs" not in trl_aliases.REFUSED
    # both names for one knob is still an error
    with pytest.raises(ValueError, match="'gradient_accumulation_steps'.*'grad_accum'"):
        load_config(GRPOConfig, ["--gradient_accumulation_steps", "2", "--grad_accum", "3"])


def test_model_init_kwargs_is_a_json_object_and_owned_keys_are_refused(tmp_path):
    c = load_config(GRPOConfig, ["--model_init_kwargs", '{"use_cache": false, "revision": "v2"}'])
    assert c.model_init_kwargs == {"use_cache": False, "revision": "v2"}
    assert c.load_options() == {"use_cache": False, "revision": "v2", "trust_remote_code": False}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_init_kwargs": {"attn_implementation": "eager"}, "trust_remote_code": True,
                                "model_revision": "abc"}))
    assert load_config(GRPOConfig, ["--config", str(path)]).load_options() == \
        {"attn_implementation": "eager", "trust_remote_code": True, "revision": "abc"}
    with pytest.raises(SystemExit):
        load_config(GRPOConfig, ["--model_init_kwargs", "[1, 2]"])  # not an object
    for bad, match in [('{"torch_dtype": "bfloat16"}', "torch_dtype .precision is bf16"),
                       ('{"device_map": "auto"}', "device_map .placement"),
                       ('{"revision": "a"}', "sets revision='a' but the option of that name says 'b'")]:
        with pytest.raises(ValueError, match=match):
            load_config(GRPOConfig, ["--model_init_kwargs", bad, "--revision", "b"])
    with pytest.raises(ValueError, match="vLLM workers"):
        load_config(GRPOConfig, ["--gen_backend", "vllm", "--model_init_kwargs", '{"use_cache": false}'])
    assert load_config(GRPOConfig, ["--gen_backend", "vllm", "--model_init_kwargs", '{"revision": "x"}']).revision \
        is None  # allowed with vLLM (it takes revision); the field stays unset, the options carry it


def test_a_validation_error_names_the_knob_as_the_user_wrote_it(tmp_path):
    """Issue 64: a user who wrote num_generations (file or command line) reads num_generations in the error, one
    who wrote num_pre_Q reads num_pre_Q; plain-word names (model, data) are never rewritten in the prose."""
    def error(argv):
        with pytest.raises(ValueError) as e:
            load_config(GRPOConfig, argv)
        return str(e.value)

    assert "num_generations must be >= 2" in error(["--num_generations", "1"])
    assert "num_pre_Q must be >= 2" in error(["--num_pre_Q", "1"])
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"max_completion_length": 0}))
    assert "max_completion_length must be >= 1" in error(["--config", str(f)])
    assert "max_completion_length" not in error(["--config", str(f), "--max_new_tokens", "0"])  # ours on the CLI
    msg = "config: model must be set; num_pre_Q must be >= 2"
    assert trl_aliases.as_written(msg, {"model_name_or_path", "num_generations"}, {"model"}) == \
        "config: model must be set; num_generations must be >= 2"
