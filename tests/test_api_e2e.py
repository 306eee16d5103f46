"""A TRL script with only the import changed, end to end (issue 65): examples/trl_script.py copied into a user's
folder outside the checkout and run there with `launch.sh python` (no PYTHONPATH, no GRPO_USER_DIR), on the tiny
model for 2 steps. Its GRPOTrainer(...).train() starts launch.sh train (ref server, one worker, DeepSpeed CPU ranks);
the ranks and the worker import the script for its rewards by name and read the dataset the script wrote once as
parquet; save_model's folder loads with from_pretrained; evaluate() runs trainer.evaluate. One run, shared by the
tests that read it; a failed run and a Ctrl-C are each a short start that stops early."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, run_process_group, user_env

pytestmark = pytest.mark.slow
SCRIPT_ARGS = ["--model", "tiny", "--max_steps", "2", "--max_completion_length", "8", "--output_dir", "out"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    shutil.copy(REPO / "examples" / "trl_script.py", folder / "trl_script.py")
    t0 = time.time()
    proc = run_process_group(["bash", str(REPO / "launch.sh"), "python", "trl_script.py", *SCRIPT_ARGS],
                             cwd=folder, env=user_env(), timeout=400)
    print(f"\ntrl_script.py through launch.sh python: {time.time() - t0:.1f} s")
    out = folder / "out"
    logs = "".join((out / n).read_text() for n in ("trainer.log", "worker0.log") if (out / n).is_file())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-3000:]
    return folder, out, proc


def test_the_script_trains_through_launch_sh_train(run):
    folder, out, proc = run
    assert "trained 2 steps, mean loss" in proc.stdout, proc.stdout[-2000:]
    assert "training done: 2 steps" in (out / "trainer.log").read_text()
    last = ast.literal_eval(next(x for x in proc.stdout.splitlines() if x.startswith("last log: "))[10:])
    assert last["step"] == 2 and last["train_loss"] == pytest.approx(float(proc.stdout.split("mean loss ")[1][:6]),
                                                                      abs=1e-4)
    assert "[launch] trainer: deepspeed --num_gpus " in proc.stderr  # launch.sh's placement, streamed to the script
    assert "note: ranks auto: " in proc.stderr  # its CPU rank count, chosen (common/placement/cpu_ranks.py) and said
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/reward_len" in r and "reward/reward_correct_sum" in r for r in rows)
    # the rewards reached the other processes as the script's own names, the dataset as one parquet file
    cfg = json.loads((out / "api_config.json").read_text())
    script = str((folder / "trl_script.py").resolve())
    assert cfg["reward_fns"] == [f"{script}:reward_correct_sum", f"{script}:reward_len"]
    assert cfg["learning_rate"] == 1e-6 and cfg["num_generations"] == 8  # TRL's names, as the script gave them
    data = str(out / "data" / "train.parquet")
    assert cfg["data"] == data
    for log in ("trainer.log", "worker0.log"):  # every producer read it
        assert f"data '{data}'" in (out / log).read_text(), log
    assert re.search(r"worker done: \d+ rounds, [1-9]\d* batches uploaded", (out / "worker0.log").read_text())
    assert "Traceback" not in (out / "trainer.log").read_text() + (out / "worker0.log").read_text()


def test_save_model_writes_a_from_pretrained_checkpoint(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, out, proc = run
    assert f"[api] model saved to {out}" in proc.stderr
    assert json.loads((out / "run_config.json").read_text())["all_steps"] == 2  # the run's, renamed for the model's
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size >= len(tok) > 0


def test_evaluate_returns_the_projects_evaluation(run):
    _, out, proc = run
    metrics = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the script's print(trainer.evaluate())
    saved = json.loads((out / "eval.json").read_text())
    assert metrics["eval_n"] == saved["n"] == 16
    assert metrics["eval_reward/reward_len"] == saved["reward/reward_len"]
    assert saved["model"] == str(out / "final")  # the trained model


def test_the_venv_python_imports_the_api_from_any_folder(tmp_path):
    py = REPO / ".venv" / "bin" / "python"
    where = subprocess.run([str(py), "-c", "import trainer; print(trainer.__file__)"], cwd=tmp_path, env=user_env(),
                           capture_output=True, text=True, timeout=60)
    if where.returncode != 0 or not where.stdout.strip().startswith(str(REPO)):
        pytest.skip(f"the venv's install of the project is another checkout's ({where.stdout.strip()})")
    code = "from trainer.api import GRPOConfig, GRPOTrainer; print(GRPOConfig(learning_rate=1e-5).lr)"
    proc = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "1e-05", proc.stderr[-2000:]


FAILING = textwrap.dedent("""
    from trainer.api import GRPOConfig, GRPOTrainer, TrainingFailed

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    if __name__ == "__main__":
        args = GRPOConfig(output_dir="out", max_steps=2, max_completion_length=8)
        trainer = GRPOTrainer(model="tiny", reward_funcs=[reward_len], args=args,
                              train_dataset=[{"text": "no prompt column here"}] * 4)
        try:
            trainer.train()
        except TrainingFailed as e:
            print(f"CAUGHT exit_code={e.exit_code} {e}")
""")


def test_a_failed_run_raises_one_exception_naming_the_cause_and_exit_code(tmp_path):
    (tmp_path / "fail.py").write_text(FAILING)
    proc = run_process_group(["bash", str(REPO / "launch.sh"), "python", "fail.py"], cwd=tmp_path, env=user_env(),
                             timeout=300)
    caught = [x for x in proc.stdout.splitlines() if x.startswith("CAUGHT")]
    assert proc.returncode == 0 and len(caught) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert caught[0].startswith("CAUGHT exit_code=2 training run failed (launch.sh exit code 2): "), caught
    assert "data" in caught[0] and "nothing was started" in caught[0], caught


def test_ctrl_c_in_the_script_stops_every_process_it_started(tmp_path):
    shutil.copy(REPO / "examples" / "trl_script.py", tmp_path / "trl_script.py")
    env = {**user_env(), "GRPO_LAUNCH_ARGS": "--skip-checks"}  # the checks are the other tests' subject
    proc = subprocess.Popen(["bash", str(REPO / "launch.sh"), "python", "trl_script.py", *SCRIPT_ARGS], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "[launch] worker0 (pid" in line:
            break
    pids = [int(x.split("(pid ")[1].split(")")[0]) for x in seen if "(pid " in x]
    assert len(pids) == 2, "".join(seen)[-3000:]  # the ref server and the worker, started by launch.sh
    proc.send_signal(signal.SIGINT)  # what Ctrl-C in the script's terminal sends it (launch.sh python exec'ed it)
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in rest, rest[-2000:]
    # stopped before its first checkpoint: launch.sh says there is nothing to resume (issue 60's first hour)
    assert "[launch] stopped everything" in rest and "there is nothing to resume" in rest, rest[-2000:]
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()]
    assert alive == [], alive
    if sys.platform.startswith("linux"):  # nothing of the run is left in its folder's processes
        ps = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
        assert ps == [], ps
