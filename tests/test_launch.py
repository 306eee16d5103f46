"""launch.sh as a new user meets it (issue 11): a port held by another run, a ref server that dies, a wrong
model path, and the stop-and-say-why paths (paths relative to where it is run and logs of an earlier attempt: read
from tests/test_e2e.py's shared run)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, run_process_group, start_ref_server, subprocess_env

from common.wire.client import RefClient

pytestmark = pytest.mark.slow


def env() -> dict:
    return subprocess_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
                          PATH=f"{REPO / '.venv' / 'bin'}:{subprocess_env()['PATH']}")


def launch(*args: str, cwd: Path = REPO, timeout: float = 400) -> subprocess.CompletedProcess:
    return run_process_group(["bash", str(REPO / "launch.sh"), "train", *args], cwd=cwd, env=env(), timeout=timeout)


def test_ref_server_refuses_a_taken_port_before_loading(tiny_model_dir):
    with start_ref_server(tiny_model_dir) as other:
        t0 = time.monotonic()
        proc = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "ref_server", "--model",
                               str(tiny_model_dir), "--port", str(other.port)], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert f"127.0.0.1:{other.port}" in proc.stderr and "model" not in proc.stderr.split("cannot listen")[0]
        assert "loaded in" not in proc.stderr  # failed before the model load
        assert time.monotonic() - t0 < 60


def test_launch_never_trains_against_a_stranger_server(tiny_model_dir, tmp_path):
    with start_ref_server(tiny_model_dir) as other:
        t0 = time.monotonic()
        proc = launch("--run-dir", str(tmp_path / "run"), "--workers", "1", "--port", str(other.port), "--",
                      "--model", "tiny", "--data", "arith", "--all_steps", "2", timeout=300)
        assert proc.returncode != 0, proc.stderr[-2000:]
        assert str(other.port) in proc.stderr
        assert time.monotonic() - t0 < 120
        h = requests.get(other.url + "/health", timeout=5).json()
        assert h["policy_version"] is None  # nothing published into it
        stats = RefClient(other.url).stats()
        assert stats.get("uploads_accepted", 0) == 0, stats
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_launch_stops_at_once_when_the_server_dies(tmp_path, free_port):
    """The ref server's own model is missing (the trainer's is fine, so launch.sh's checks pass: a missing trainer
    model stops the run before anything starts, tests/test_check_and_watch.py)."""
    t0 = time.monotonic()
    proc = launch("--run-dir", str(tmp_path / "run"), "--workers", "0", "--port", str(free_port),
                  "--ref-model", "./no/such/model", "--", "--model", "tiny", "--data", "arith", "--all_steps", "1",
                  timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120  # not the 300 s health wait
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    log = (tmp_path / "run" / "ref_server.log").read_text()
    assert "Traceback" not in log and len(log.strip().splitlines()) <= 3, log


# Relative --run-dir/--data from another folder and a second attempt keeping the first one's logs: read from
# tests/test_e2e.py's shared run (test_paths_are_relative_to_the_caller_and_logs_rotate there), one run fewer.


@pytest.fixture(scope="module")
def qwen_base_bf16_dir(request) -> Path:
    """The base real-vocabulary checkpoint stored in bfloat16, as Qwen ships it."""
    from qwen_vocab import cached_checkpoint
    return cached_checkpoint(request.config.cache.mkdir("qwen_vocab"), "base", dtype="bfloat16")


def _read_rows(run: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"  # the read-only copy beside the repo
REAL = ["--data", str(GSM8K_DIR), "--reward_fns", "toy_rewards:digit_fraction", "--max_new_tokens", "6",
        "--num_pre_Q", "2", "--max_prompt_length", "400", "--get_wait", "3", "--train_zero_spread", "true",
        "--save_steps", "1", "--all_steps", "2", "--data_limit", "16"]


@pytest.mark.parametrize("variant", ["base_bf16", "instruct"])
def test_launch_train_on_real_vocabulary(variant, request, tmp_path, free_port, checks_pass):
    """launch.sh train on a Qwen2.5-vocabulary checkpoint: checkpoints keep eos, pad, template and dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K not available at {GSM8K_DIR}")
    model = request.getfixturevalue("qwen_base_bf16_dir" if variant == "base_bf16" else "qwen_instruct_dir")
    # base: no system turn at all; instruct: docs/training.md's memory settings: bf16 ref server and workers
    # (launch.sh flags), bf16 ranks under DeepSpeed on CPU and gradient checkpointing
    launcher = [] if variant == "base_bf16" else ["--ref-dtype", "bfloat16", "--worker-dtype", "bfloat16"]
    trainer = ["--system_prompt", "none"] if variant == "base_bf16" else \
        ["--bf16", "true", "--gradient_checkpointing", "true"]
    run = tmp_path / "run"
    # the checks of `launch.sh check` (the real tokenizer, the first prompt through its chat template, the rewards,
    # disk for twice the model), in this process, on the arguments launch.sh hands them (its --worker-dtype becomes
    # --worker_dtype); train then skips them
    worker_dtype = ["--worker_dtype", "bfloat16"] if "--worker-dtype" in launcher else []
    skip = checks_pass(REPO, "--run-dir", str(run), "--port", str(free_port), "--", "--model", str(model), *REAL,
                       *trainer, *worker_dtype)
    proc = launch(*skip, "--run-dir", str(run), "--workers", "1", "--port", str(free_port), *launcher, "--",
                  "--model", str(model), *REAL, *trainer, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _read_rows(run)] == [1, 2]
    src_tok = AutoTokenizer.from_pretrained(model)
    for name in ("step_1", "final"):
        tok = AutoTokenizer.from_pretrained(run / name)
        assert (tok.eos_token, tok.pad_token) == (src_tok.eos_token, src_tok.pad_token)
        assert tok.chat_template == src_tok.chat_template and len(tok) == 151665
        conf = AutoConfig.from_pretrained(run / name)
        assert conf.dtype == AutoConfig.from_pretrained(model).dtype  # the model's own dtype on disk
    assert not (run / "step_2").exists()
    m = AutoModelForCausalLM.from_pretrained(run / "final")
    assert m.get_input_embeddings().weight.shape[0] == 151936
    stops = "stop ids: [151643, 151645]"
    assert stops in (run / "worker0.log").read_text() and stops in (run / "trainer.log").read_text()
    if variant == "instruct":  # bf16 workers get bf16 weights: half the bytes of float32 through the relay
        numel = sum(p.numel() for p in m.parameters())
        sync_mb = max(r.get("sync_mb", 0) for r in _read_rows(run))
        assert numel * 2 <= sync_mb * 1e6 < numel * 2 + 1e6
        assert "bfloat16" in (run / "ref_server.log").read_text()
        # the ranks train bf16 weights (fp32 master copy of each partition inside DeepSpeed)
        assert _read_rows(run)[0]["full_weights_mb"] == pytest.approx(numel * 2 / 1e6, rel=1e-3)
