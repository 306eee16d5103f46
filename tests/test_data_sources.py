"""Data the way TRL users have it (issue 31): .json/.json.gz/.csv files, prompt-only rows (ground truth None,
refused by the built-ins that need one), conversational prompts without a flag, dataset_config (a local dataset
folder with configurations, and a hub id through an offline Hugging Face cache), and eval_data / no eval on
training rows."""
from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_rewards, loaded by dotted path

from common.config import GRPOConfig  # noqa: E402
from common.settings.knobs import load_config  # noqa: E402
from trainer.data import run_data  # noqa: E402
from trainer.data.loading import ColumnSpec, load_examples  # noqa: E402
from trainer.rewards.builtin import reward_correct  # noqa: E402
from trainer.rewards.scoring import RewardScorer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ROWS = [{"prompt": "2+2?", "ground_truth": "4", "level": 1}, {"prompt": "3+4?", "ground_truth": "7", "level": 2}]
CONV = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def cfg(**kw) -> GRPOConfig:
    return GRPOConfig(**kw).validate()


# ----------------------------------------------------------------------------- file formats
def test_json_array_json_lines_gz_and_csv_load_as_jsonl_does(tmp_path):
    want = load_examples(str(jsonl(tmp_path / "a.jsonl", ROWS)))
    (tmp_path / "b.json").write_text(json.dumps(ROWS, indent=2))  # a JSON array over many lines
    jsonl(tmp_path / "c.json", ROWS)  # JSON lines under .json (datasets' to_json writes these)
    with gzip.open(tmp_path / "d.json.gz", "wt", encoding="utf-8") as f:
        json.dump(ROWS, f)
    with gzip.open(tmp_path / "e.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    for name in ("b.json", "c.json", "d.json.gz", "e.jsonl.gz"):
        assert load_examples(str(tmp_path / name)) == want, name
    assert load_examples(str(tmp_path / "b.json"), limit=1) == want[:1]
    with (tmp_path / "f.csv").open("w", newline="") as f:  # csv: every value a string
        w = csv.DictWriter(f, ["question", "answer"])
        w.writeheader()
        w.writerow({"question": "How many, then?", "answer": "3+4=7\n#### 1,007"})
    ex = load_examples(str(tmp_path / "f.csv"))[0]
    assert (ex.prompt, ex.ground_truth) == ("How many, then?", "1007")


def test_split_files_in_a_folder_any_format(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(ROWS))
    (tmp_path / "test.csv").write_text("prompt,ground_truth\n9+9?,18\n")
    assert [e.ground_truth for e in load_examples(str(tmp_path))] == ["4", "7"]
    assert [e.ground_truth for e in load_examples(str(tmp_path), split="test")] == ["18"]
    jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(ValueError, match="several files for split 'train'"):
        load_examples(str(tmp_path))


def test_file_errors_name_file_and_line(tmp_path):
    (tmp_path / "bad.json").write_text('[{"prompt": "a", "ground_truth": "1"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"bad\.json:2: invalid JSON"):
        load_examples(str(tmp_path / "bad.json"))
    (tmp_path / "bad.csv").write_text("prompt,ground_truth\na,1\nb\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3: 1 fields, but the header has 2"):
        load_examples(str(tmp_path / "bad.csv"))
    (tmp_path / "obj.json").write_text('{\n "rows": []\n}')
    with pytest.raises(ValueError, match="JSON array of rows or one JSON object per line"):
        load_examples(str(tmp_path / "obj.json"))


def test_relative_paths_start_from_the_users_folder(tmp_path, monkeypatch):
    jsonl(tmp_path / "mine.jsonl", ROWS)
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))  # launch.sh exports the folder it ran in
    monkeypatch.chdir(REPO)  # launch.sh runs the trainer from the checkout
    assert len(load_examples("mine.jsonl")) == 2
    with pytest.raises(FileNotFoundError, match=f"relative paths start from {tmp_path}"):
        load_examples("missing.json")


# ----------------------------------------------------------------------------- prompt-only rows
def test_prompt_only_rows_have_no_ground_truth(tmp_path):
    f = jsonl(tmp_path / "p.jsonl", [{"prompt": "Write a haiku.", "id": 7}, {"prompt": "Tell a joke.", "id": 8}])
    exs = load_examples(str(f))
    assert [(e.prompt, e.ground_truth, e.columns) for e in exs] == [("Write a haiku.", None, {"id": 7}),
                                                                  ("Tell a joke.", None, {"id": 8})]
    jsonl(f, [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b"}])  # a row that lost its answer column
    with pytest.raises(ValueError, match="example 1 has an answer but example 2 has none"):
        load_examples(str(f))
    jsonl(f, [{"prompt": "a", "ground_truth": None}])  # an answer column holding null is still an error
    with pytest.raises(ValueError, match="ground_truth must be"):
        load_examples(str(f))
    tmpl = load_examples(str(jsonl(f, [{"topic": "cats"}])), columns=ColumnSpec(prompt_template="About {topic}."))
    assert (tmpl[0].prompt, tmpl[0].ground_truth) == ("About cats.", None)


@pytest.mark.parametrize("timeout", [0, 5.0])  # 5.0: through the reward process (JSON lines: None -> null -> None)
def test_prompt_only_ground_truth_reaches_both_kinds_of_reward(tmp_path, timeout):
    exs = load_examples(str(jsonl(tmp_path / "p.json", [{"prompt": "Write a haiku.", "id": 7}])))
    s = RewardScorer(["trl_rewards:no_truth", "trl_rewards:reward_len", "trl_rewards:row_id", "format"],
                     timeout=timeout)
    try:
        sc = s.score_group(exs[0], ["x" * 20, "short"])
        assert sc.components == {"no_truth": [1.0, 1.0], "reward_len": [0.0, -15.0], "row_id": [7.0, 7.0],
                                 "format": [-1.0, -1.0]}
    finally:
        s.close()


def test_builtins_that_need_a_ground_truth_refuse_prompt_only_data_at_start(tmp_path):
    data = str(jsonl(tmp_path / "p.jsonl", [{"prompt": "Write a haiku.", "id": 7}]))
    assert len(run_data.train_examples(cfg(data=data, reward_fns=["format", "trl_rewards:reward_len"]))) == 1
    for spec in ("correct", "contains", "countdown", "math_verify", "trainer.rewards:reward_total"):
        with pytest.raises(ValueError) as e:
            run_data.train_examples(cfg(data=data, reward_fns=["format", spec]))
        msg = str(e.value)
        assert "\n" not in msg and f"reward {spec!r} needs a ground truth" in msg and data in msg, msg
        assert "prompt-only" in msg and "answer_column" in msg
    with pytest.raises(ValueError, match="reward 'correct' needs a ground truth"):
        reward_correct("<answer>4</answer>", None)  # called directly: the same words, not an AttributeError


# ----------------------------------------------------------------------------- conversational without a flag
def test_message_list_prompts_are_conversational_by_default(tmp_path):
    f = str(jsonl(tmp_path / "m.jsonl", [{"prompt": CONV, "ground_truth": "4"}]))
    c = load_config(GRPOConfig, ["--data", f])
    assert c.prompt_format == "auto"
    ex = run_data.train_examples(c)
    assert ex[0].prompt == CONV
    s = RewardScorer.from_config(load_config(GRPOConfig, ["--reward_fns", "trl_rewards:digit_reward"]))
    try:  # TRL-style rewards get message completions for a conversation, strings for a text prompt
        assert s.score_group(ex[0], ["12", "ab"]).components["digit_reward"] == [1.0, 0.0]
        assert s._trl_kwargs(ex[0], ["12"], None)["completions"] == [[{"role": "assistant", "content": "12"}]]
        text = load_examples(str(jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2", "ground_truth": "4"}])))[0]
        assert s._trl_kwargs(text, ["12"], None)["completions"] == ["12"]
    finally:
        s.close()
    jsonl(Path(f), [{"prompt": CONV, "ground_truth": "4"}, {"prompt": "2+2", "ground_truth": "4"}])
    with pytest.raises(ValueError, match="example 1 has a message-list prompt but example 2 has none"):
        load_examples(f)


# ----------------------------------------------------------------------------- dataset_config
def _config_folder(root: Path, name: str = "toyds") -> Path:
    """A dataset folder with two configurations, as on the hub: a README.md whose YAML lists data_files."""
    folder = root / name
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: easy\n  data_files:\n  - split: train\n    path: data/easy_train.jsonl\n"
        "  - split: test\n    path: data/easy_test.jsonl\n"
        "- config_name: hard\n  data_files:\n  - split: train\n    path: data/hard_train.jsonl\n---\n# toy\n")
    jsonl(folder / "data/easy_train.jsonl", [{"prompt": "1+1?", "ground_truth": "2"}])
    jsonl(folder / "data/easy_test.jsonl", [{"prompt": "2+2?", "ground_truth": "4"}])
    jsonl(folder / "data/hard_train.jsonl", [{"prompt": "9*9?", "ground_truth": "81"}])
    return folder


def test_dataset_config_picks_a_configuration_of_a_dataset_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = str(_config_folder(tmp_path))
    c = load_config(GRPOConfig, ["--data", folder, "--dataset_config", "hard"])
    assert [e.ground_truth for e in run_data.train_examples(c)] == ["81"]
    c = load_config(GRPOConfig, ["--data", folder, "--dataset_config", "easy", "--eval_steps", "5"])
    assert [e.ground_truth for e in run_data.eval_examples(c)] == ["4"]
    with pytest.raises(ValueError, match="easy"):  # none given, several defined: datasets names them
        load_examples(folder)
    with pytest.raises(ValueError, match="dataset_config 'easy' picks a configuration"):
        load_examples(str(jsonl(tmp_path / "one.jsonl", ROWS)), config="easy")
    with pytest.raises(ValueError, match="dataset_config must be"):
        cfg(dataset_config="")


def test_dataset_config_picks_a_configuration_of_a_hub_id_from_the_offline_cache(tmp_path):
    """A hub id as a user who downloaded it once has it: prepared in the datasets cache, read with the hub offline
    (built here from a local folder named like the hub dataset, then filed under its hub name)."""
    cache = tmp_path / "hf_datasets"
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home")}
    folder = _config_folder(tmp_path)
    prepare = "import datasets, sys; [datasets.load_dataset(sys.argv[1], n) for n in ('easy', 'hard')]"
    subprocess.run([sys.executable, "-c", prepare, str(folder)], env=env, cwd=tmp_path, check=True,
                   capture_output=True)
    (cache / "toyds").rename(cache / "someone___toyds")  # where datasets keeps the hub id someone/toyds
    probe = ("import sys; from trainer.data.loading import load_examples\n"
             "for split, config in (('train', 'hard'), ('test', 'easy')):\n"
             "    print(split, config, [e.ground_truth for e in load_examples('someone/toyds', split, config=config)])")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["train hard ['81']", "test easy ['4']"]


# ----------------------------------------------------------------------------- eval_data: never the training rows
def test_eval_steps_on_one_file_needs_eval_data(tmp_path):
    data, held = str(jsonl(tmp_path / "train.json", ROWS)), str(jsonl(tmp_path / "held.jsonl", ROWS[:1]))
    for flag in (["--eval_steps", "10"], ["--eval_before", "true"]):
        with pytest.raises(ValueError, match="is one file with no eval split: give eval_data") as e:
            load_config(GRPOConfig, ["--data", data, *flag])
        assert "\n" not in str(e.value)
    c = load_config(GRPOConfig, ["--data", data, "--eval_steps", "10", "--eval_data", held])
    assert run_data.eval_examples(c) == load_examples(held)
    assert len(run_data.train_examples(c, limit=1)) == 1 and len(run_data.eval_examples(c, limit=0)) == 0
    assert run_data.eval_examples(load_config(GRPOConfig, ["--data", data])) == []  # no eval asked: none loaded
    with pytest.raises(ValueError, match="one file with no eval split"):  # a caller that skipped validate()
        run_data.eval_examples(GRPOConfig(data=data, eval_before=True))


def test_eval_on_a_folder_or_dataset_without_an_eval_split_is_refused_at_load(tmp_path):
    jsonl(tmp_path / "train.jsonl", ROWS)
    c = load_config(GRPOConfig, ["--data", str(tmp_path), "--eval_steps", "10"])
    with pytest.raises(ValueError, match="split 'test', which did not load.*give eval_data") as e:
        run_data.eval_examples(c)
    assert "\n" not in str(e.value)
    jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(run_data.eval_examples(c)) == 1
    arith = load_config(GRPOConfig, ["--data", "arith", "--eval_steps", "10", "--eval_limit", "3"])  # the demo's
    assert len(run_data.eval_examples(arith)) == 3


def test_prompt_only_eval_data_is_checked_against_the_rewards(tmp_path):
    data, held = str(jsonl(tmp_path / "train.jsonl", ROWS)), str(jsonl(tmp_path / "held.json", [{"prompt": "p"}]))
    c = load_config(GRPOConfig, ["--data", data, "--eval_steps", "5", "--eval_data", held])
    with pytest.raises(ValueError, match=f"reward 'correct' needs a ground truth, but data '{held}'"):
        run_data.eval_examples(c)


def test_trl_data_names(tmp_path):
    c = load_config(GRPOConfig, ["--dataset_name", "arith", "--dataset_train_split", "train",
                                 "--dataset_test_split", "test", "--dataset_config", "main"])
    assert (c.data, c.data_split, c.eval_split, c.dataset_config) == ("arith", "train", "test", "main")
