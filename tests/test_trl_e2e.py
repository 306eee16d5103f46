"""Issue 40's done-when, run as a user runs it: launch.sh from a folder outside the checkout, no PYTHONPATH.

- `--config configs/trl_defaults.json`: a text prompt reaches the model as TRL 1.16 sends it: `launch.sh check`
  prints it as is (no chat template, no system prompt). That completions.jsonl's `prompt` is then the user's text,
  for the batches a genonly worker produced, is checked on tests/test_user_code.py's run, whose config is
  trl_defaults.json with a user's changes on top (one `launch.sh train` start-up for both).
- `launch.sh check -- --use_vllm true` with a worker passes (a vLLM worker in the plan); `--push_to_hub true` is
  refused on the command line with the reason the JSON file gives.
"""
from __future__ import annotations

import json

import pytest
from conftest import REPO, find_free_port
from conftest import launch_as_user as launch

TRL_DEFAULTS = str(REPO / "configs" / "trl_defaults.json")
PROMPTS = [f"Write the number {n} in digits." for n in range(12)]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def digits(completion, ground_truth):\n"
                                            "    chars = [c for c in completion if not c.isspace()]\n"
                                            "    return sum(c.isdigit() for c in chars) / max(1, len(chars))\n")
    (tmp_path / "train.json").write_text(json.dumps([{"prompt": p} for p in PROMPTS]))
    return tmp_path


ARGS = ["--model", "tiny", "--data", "train.json", "--reward_fns", "my_rewards:digits", "--max_completion_length", "8",
        "--bf16", "false", "--logging_steps", "1", "--reward_timeout", "5"]


def test_check_prints_the_trl_prompt_and_refuses_push_to_hub_with_the_reason(folder, check_in):
    ok = launch(folder, "check", "--config", TRL_DEFAULTS, "--port", str(find_free_port()), "--", *ARGS)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shown = [line for line in ok.stdout.splitlines() if line.startswith("     | ")]
    assert shown == ["     | " + PROMPTS[0]], ok.stdout  # as the model sees it: the text, nothing around it
    vllm = launch(folder, "check", "--workers", "1", "--port", str(find_free_port()), "--", *ARGS, "--use_vllm",
                  "true")
    assert vllm.returncode == 0 and "check: all passed" in vllm.stdout, vllm.stdout + vllm.stderr
    assert "workers generate with vllm" in vllm.stdout, vllm.stdout  # TRL's use_vllm: gen_backend vllm
    # the TRL options' refusals and acceptances: through trainer.check itself (what `launch.sh check` execs, in the
    # folder with its GRPO_USER_DIR), each launch.sh call costing a torch + transformers import for a config line
    def run(*args: str) -> tuple[int, str]:
        code, out, err = check_in(folder, "--port", str(find_free_port()), "--", *ARGS, *args)
        return code, out + err

    code, out = run("--push_to_hub", "true")
    assert code != 0 and "'push_to_hub'=True (pushing to the Hugging Face Hub is not supported" in out, out
    assert "unknown option" not in out
    (folder / "hub.json").write_text(json.dumps({"push_to_hub": True}))
    code, out = run("--config", "hub.json")
    assert code != 0 and "'push_to_hub'=True (pushing" in out, out
    code, out = run("--push_to_hub", "false", "--remove_unused_columns", "false", "--shuffle_dataset", "true")
    assert code == 0, out  # what we do anyway: accepted
