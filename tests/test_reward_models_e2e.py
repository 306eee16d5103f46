"""Reward models end to end (issue 44), from a user's folder outside the checkout, PYTHONPATH unset, through
`launch.sh train` on the tiny model (real ref server, 2 DeepSpeed CPU ranks, one HF genonly worker), with
reward_fns = [a locally built random-weight Qwen2ForSequenceClassification folder `tiny-rm`, "format"] and
conversational data:

- 3 steps train; every completions.jsonl row's `rewards` has `tiny-rm`, equal within 1e-3 to the score transformers
  gives the same prompt messages + completion rendered as TRL 1.16 renders them (fp32 on CPU);
- only the ref server loads the reward model's weights: its log says so, the producers' logs say they send text;
- a reward model whose weights cannot load ends the run before training, in one line naming it.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import REPO, find_free_port, run_process_group, user_env
from test_reward_models import build_rm, trl_score

pytestmark = pytest.mark.slow
QUESTIONS = [f"Say a number near {i}." for i in range(8)]


def launch(user, name: str, reward_fns: list[str], checks_pass=None) -> subprocess.CompletedProcess:
    """`launch.sh train` from the user's folder; with `checks_pass` (tests/conftest.py) the checks run here first."""
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS)]
    (user / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", "tiny", "--data", "train.jsonl", "--reward_fns", json.dumps(reward_fns), "--num_pre_Q", "4",
            "--Q_batch_size", "1", "--max_new_tokens", "12", "--all_steps", "3", "--save_steps", "100",
            "--get_wait", "2", "--train_zero_spread", "true", "--log_completions", "true", "--lr", "1e-5"]
    port = find_free_port()
    skip = checks_pass(user, "--run-dir", name, "--port", str(port), "--", *args) if checks_pass else []
    cmd = ["bash", str(REPO / "launch.sh"), "train", *skip, "--run-dir", name, "--workers", "1", "--gpus", "2",
           "--port", str(port), "--", *args]
    return run_process_group(cmd, cwd=user, env=user_env(), timeout=900)


def test_reward_model_served_by_the_ref_server(tmp_path, checks_pass):
    user = tmp_path / "user"
    user.mkdir()
    rm = build_rm(user / "tiny-rm")
    proc = launch(user, "run", ["tiny-rm", "format"], checks_pass)
    run = user / "run"
    logs = {n: (run / f"{n}.log").read_text(errors="replace") for n in ("ref_server", "trainer", "worker0")}
    assert proc.returncode == 0, proc.stderr[-3000:] + logs["trainer"][-3000:] + logs["worker0"][-3000:]
    assert "training done: 3 steps" in logs["trainer"] and "Traceback" not in "".join(logs.values())
    # only the ref server loads the weights; every producer (the ranks, the worker) scores through it
    assert re.search(r"reward model tiny-rm loaded from .*tiny-rm", logs["ref_server"])
    for name in ("trainer", "worker0"):
        assert "reward model tiny-rm loaded" not in logs[name]
        assert "reward model tiny-rm (tiny-rm): scored by the ref server http://127.0.0.1:" in logs[name], name
    rows = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines() if x.strip()]
    assert {r["step"] for r in rows} == {1, 2, 3}
    for r in rows:
        assert set(r["rewards"]) == {"tiny-rm", "format"}
        q = next(q for q in QUESTIONS if f"\n{q}<|im_end|>" in r["prompt"])
        want = trl_score(rm, [{"role": "user", "content": q}], r["completion"])
        assert r["rewards"]["tiny-rm"] == pytest.approx(want, abs=1e-3), r
        assert r["reward"] == pytest.approx(r["rewards"]["tiny-rm"] + r["rewards"]["format"], abs=1e-4)


def test_reward_model_that_cannot_load_ends_the_run_naming_it(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    bad = build_rm(user / "bad-rm")
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = launch(user, "run", ["bad-rm", "format"])
    assert proc.returncode != 0
    assert re.search(r"reward model 'bad-rm' \(.*bad-rm\) failed to load: ", proc.stderr), proc.stderr[-3000:]
    assert not (user / "run" / "trainer.log").is_file() or "training done" not in (user / "run" / "trainer.log"
                                                                                    ).read_text()
