"""The Python API's mapping and refusals (issue 65), in this process: TRL's GRPOConfig names through the JSON
config's loader, GRPOTrainer's arguments as config fields, a lambda / closure / function under the main guard refused
in one line, a peft.LoraConfig as our lora_* knobs, datasets written once as parquet and read back by the producers'
loader. The end-to-end run of examples/trl_script.py: tests/test_api_e2e.py."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
from datasets import Dataset

import trainer.api.names as api_names
from trainer.api import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": "What is 1 + 2?", "expected": "3"}, {"prompt": "What is 2 + 2?", "expected": "4"}]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make(tmp_path, **kw):
    args = kw.pop("args", None) or GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2)
    return GRPOTrainer(**{"model": "tiny", "reward_funcs": [reward_digits], "args": args,
                          "train_dataset": Dataset.from_list(ROWS), **kw})


def test_config_takes_trl_names_and_ours_and_refuses_by_name():
    args = GRPOConfig("out", learning_rate=1e-5, num_generations=4, lr_scheduler_type="cosine", beta=0.0,
                      save_steps=7)
    assert args.learning_rate == 1e-5 and args.lr == 1e-5 and args.num_pre_Q == 4  # as given, and our field
    assert args.lr_schedule == "cosine" and args.output_dir == "out" and args.save_steps == 7
    assert args.resolved.beta == 0.0 and args.to_dict()["num_generations"] == 4
    args.learning_rate = 2e-5  # TRL scripts set fields after construction: checked the same way
    assert args.resolved.lr == 2e-5
    for bad, words in (({"fp16": True}, "'fp16'=True (precision comes from bf16"),
                       ({"steps_per_generation": 4}, "'steps_per_generation'=4 (batch shape"),
                       ({"learning_rate": 1e-5, "lr": 2e-5}, "'learning_rate' (1e-05) and our 'lr' (2e-05)"),
                       ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial' is not supported"),
                       ({"num_genrations": 4}, "did you mean 'num_generations'"),
                       ({"model_init_kwargs": {"dtype": object()}}, "is not a plain value")):
        with pytest.raises(ValueError) as e:
            GRPOConfig(**bad)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="num_pre_Q must be >= 2"):
        args.num_generations = 1


def test_trainer_arguments_become_the_run_config(tmp_path):
    trainer = make(tmp_path, eval_dataset=ROWS, reward_funcs=[reward_digits, "format", "my_rewards:acc"],
                   tools=["calculator"])
    v = trainer._values
    assert v["model"] == "tiny" and v["max_steps"] == 2 and v["tools"] == ["calculator"]
    assert v["reward_fns"] == [f"{__name__}:reward_digits", "format", "my_rewards:acc"]  # importable names
    assert v["output_dir"] == str(tmp_path / "run") and trainer.config.all_steps == 2
    config = trainer._write_inputs()
    assert json.loads(config.read_text())["data"] == str(tmp_path / "run" / "data" / "train.parquet")
    from trainer.data.loading import load_examples  # what every producer reads
    rows = load_examples(v["data"], split="train")
    assert [r.prompt for r in rows] == [r["prompt"] for r in ROWS]
    assert [r.columns.get("expected") for r in rows] == ["3", "4"]
    assert len(load_examples(v["eval_data"], split="test")) == 2
    written = (tmp_path / "run" / "data" / "train.parquet").stat().st_mtime_ns
    trainer._write_inputs()  # a resume's or an evaluate()'s: the config again, the datasets not
    assert (tmp_path / "run" / "data" / "train.parquet").stat().st_mtime_ns == written
    streamed = make(tmp_path, train_dataset=Dataset.from_list(ROWS).to_iterable_dataset(),
                    args=GRPOConfig(output_dir=str(tmp_path / "it")))
    assert len(load_examples(str(streamed._write_inputs().parent / "data" / "train.parquet"), split="train")) == 2
    with pytest.raises(ValueError, match="train_dataset is a dict of datasets; pass one split"):
        make(tmp_path, train_dataset={"train": Dataset.from_list(ROWS)})  # at construction
    # as TRL: without args, a folder named after the model, in the folder the script runs in
    assert GRPOTrainer("org/Some-Model", [reward_digits], train_dataset=ROWS).run_dir.name == "Some-Model-GRPO"


def test_a_lambda_a_closure_and_what_cannot_be_named_are_refused_in_one_line(tmp_path):
    def closure(completions, **kwargs):
        return [0.0] * len(completions)

    import functools
    for bad, words in ((lambda completions, **kw: [0.0], "'<lambda>' is a lambda"),
                       (closure, "is a closure"), (functools.partial(reward_digits), "has no importable name")):
        with pytest.raises(ValueError) as e:
            make(tmp_path, reward_funcs=[reward_digits, bad])
        msg = str(e.value)
        assert msg.startswith("reward_funcs[1]: ") and words in msg and "\n" not in msg, msg
        assert "define it with `def my_reward_func(...):` at the top level of your script" in msg or \
            "has no importable name" in msg
    with pytest.raises(ValueError, match=r"^tools\[0\]: '<lambda>' is a lambda.*def my_tool"):
        make(tmp_path, tools=[lambda x: x])
    with pytest.raises(ValueError, match=r"^environment_factory: .*class MyEnv:"):
        make(tmp_path, environment_factory=type("Env", (), {}))


def test_names_under_the_main_guard_are_not_importable_by_the_others(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os
        from math import sqrt as root
        def top(completions, **kw): return completions
        if os.environ.get("X"):
            def maybe(completions, **kw): return completions
        if __name__ == "__main__":
            def hidden(completions, **kw): return completions
    """))
    import ast
    names = api_names._top_level_names(ast.parse(script.read_text()).body)
    assert {"top", "maybe", "root", "os"} <= names and "hidden" not in names


def test_trl_arguments_we_cannot_honour_are_refused_by_name(tmp_path):
    for kw, words in (({"callbacks": [object()]}, "callbacks (the training loop runs in other processes"),
                      ({"optimizers": (object(), None)}, "optimizers (the optimizer is DeepSpeed's AdamW"),
                      ({"quantization_config": {"load_in_4bit": True}}, "quantization_config (quantized"),
                      ({"rollout_func": reward_digits}, "rollout_func (rollouts are this system's")):
        with pytest.raises(ValueError, match="argument\\(s\\) we cannot honour") as e:
            make(tmp_path, **kw)
        assert words in str(e.value)
    with pytest.raises(ValueError, match="model given in GRPOConfig and as a GRPOTrainer argument"):
        make(tmp_path, args=GRPOConfig(str(tmp_path / "r"), model="tiny"))
    with pytest.raises(ValueError, match="train_dataset is needed"):
        make(tmp_path, train_dataset=None)
    with pytest.raises(ValueError, match="launch_args --run-dir"):
        make(tmp_path, launch_args=["--run-dir", "x"])
    with pytest.raises(ValueError, match="save_model: .* holds no trained model; call train"):
        make(tmp_path).save_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="evaluate: needs an eval_dataset"):
        make(tmp_path).evaluate()


def test_peft_lora_config_maps_onto_our_lora_knobs(tmp_path):
    from peft import LoraConfig
    trainer = make(tmp_path, peft_config=LoraConfig(r=4, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                    target_modules=["v_proj", "q_proj"]))
    c = trainer.config
    assert (c.lora_r, c.lora_alpha, c.lora_dropout, c.lora_target_modules) == (4, 32.0, 0.05, ["q_proj", "v_proj"])
    assert make(tmp_path, peft_config=LoraConfig()).config.lora_r == 8  # peft's defaults, as TRL gets them
    for cfg, words in ((LoraConfig(use_dora=True, bias="all"), "bias, use_dora"),
                       (LoraConfig(use_rslora=True), "use_rslora"),
                       (LoraConfig(target_modules="all-linear"), "give the module names as a list"),
                       (LoraConfig(task_type="SEQ_CLS"), "a policy is a causal LM")):
        with pytest.raises(ValueError, match="peft_config") as e:
            make(tmp_path, peft_config=cfg)
        assert words in str(e.value)


def test_a_loaded_model_and_tokenizer_are_used_by_name(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tiny_model import ensure_tiny_model
    path = str(ensure_tiny_model())
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    trainer = make(tmp_path, model=model, processing_class=tok)
    assert trainer.config.model == path
    assert f"every process loads {path} (its name_or_path)" in capsys.readouterr().err
    other = AutoTokenizer.from_pretrained(path)
    other.name_or_path = str(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="processing_class .* is not the model's"):
        make(tmp_path, model=path, processing_class=other)


def test_the_api_imports_without_torch():
    import subprocess
    code = "import sys, trainer.api; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
