"""Bring your own data and rewards, end to end (issue 13 + issue 16's reward timeout): a ReasonRL-style JSONL
(prompts already templated, prompt_format raw) and a TRL-style reward module, unchanged, through
`launch.sh train` on the tiny model: real ref server, one genonly worker, 2 DeepSpeed CPU ranks.

One TRL reward hangs forever on the rows whose ground truth is "hang": the run must still finish, count
`reward_timeouts`, and spend about one timeout per hung call.
"""
from __future__ import annotations

import json
import time

import pytest
from conftest import REPO, find_free_port, run_process_group, subprocess_env

pytestmark = pytest.mark.slow

TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_reasonrl_jsonl_and_trl_rewards_through_launch(tmp_path, checks_pass):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": TEMPLATE.format(q), "ground_truth": gt, "level": i}
            for i, (q, gt) in enumerate([("3+4", "7"), ("2+2", "hang"), ("5+1", "hang"), ("9-3", "6")])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, port = tmp_path / "run", find_free_port()
    args = ["--model", "tiny", "--data", str(data), "--prompt_format", "raw", "--system_prompt", "",
            "--reward_fns", "trl_rewards:digit_reward,trl_rewards:hang_on_marker,contains",
            "--reward_weights", "[1.0, 1.0, 0.5]", "--reward_timeout", "2",
            "--num_generations", "8", "--max_completion_length", "8", "--learning_rate", "1e-4",
            "--temperature", "1.0", "--Q_batch_size", "2", "--get_wait", "3", "--max_steps", "3", "--save_steps", "100"]
    env = subprocess_env(PYTHONPATH=f"{REPO / 'tests'}:{REPO}",
                         PATH=f"{REPO / '.venv' / 'bin'}:{subprocess_env()['PATH']}")
    skip = checks_pass(REPO, "--run-dir", str(run_dir), "--port", str(port), "--", *args)
    cmd = ["bash", str(REPO / "launch.sh"), "train", *skip, "--run-dir", str(run_dir), "--workers", "1", "--gpus", "2",
           "--port", str(port), "--", *args]
    t0 = time.time()
    proc = run_process_group(cmd, cwd=REPO, env=env, timeout=600)
    seconds = time.time() - t0
    logs = "".join((run_dir / n).read_text() for n in ("trainer.log", "worker0.log") if (run_dir / n).is_file())
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
    assert "training done: 3 steps" in (run_dir / "trainer.log").read_text()
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["num_pre_Q"] == 8 and cfg["max_new_tokens"] == 8 and cfg["lr"] == 1e-4 and cfg["all_steps"] == 3

    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # per-function means reach the metrics
        assert "reward/digit_reward" in m and "reward/contains" in m and "reward_timeouts" in m
    hung = logs.count("timed out")
    assert hung >= 1, logs[-3000:]  # every hung call is logged, once, with the function name
    assert "'hang_on_marker' timed out" in logs
    assert sum(m["reward_timeouts"] for m in metrics) >= 1  # and counted in what was trained on
    assert "Traceback" not in logs
    print(f"byo e2e: {seconds:.0f} s, {hung} hung reward calls")
