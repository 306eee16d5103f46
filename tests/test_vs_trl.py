"""bench/vs_trl.py's parts that run without TRL (issue 45): the TRL side's GRPOConfig holds the issue's settings, and
the CPU meter counts every process of a run, one that left the process tree included, and one run compares ours with
TRL at each thread count (issue 62). The whole bench runs in tests/test_bench_smoke.py (both sides where this Python
has the pinned trl 1.16 or TRL's own environment exists; our side only otherwise)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

TRL_SCRIPT = REPO / "bench" / "vs_trl_lib" / "trl_grpo.py"


def test_trl_side_config_is_the_issues(tmp_path):
    """`--print-config` needs no TRL: the project's Python prints the GRPOConfig kwargs the TRL run uses."""
    out = subprocess.run([sys.executable, str(TRL_SCRIPT), "--model", "m", "--data", "d", "--out", str(tmp_path),
                          "--steps", "7", "--seed", "3", "--print-config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kw = json.loads(out.stdout.strip().splitlines()[-1])
    want = dict(max_steps=7, seed=3, per_device_train_batch_size=64, num_generations=8, max_completion_length=32,
                temperature=1.0, beta=0.04, learning_rate=1e-4, lr_scheduler_type="constant", loss_type="grpo",
                scale_rewards="group", epsilon=0.2, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, bf16=False,
                fp16=False, eval_strategy="no", save_strategy="no", logging_steps=1)
    assert {k: kw.get(k) for k in want} == want
    assert kw["model_init_kwargs"] == {"dtype": "float32"}


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_cpu_meter_counts_children_and_an_orphan_that_left_the_tree(tmp_path, monkeypatch):
    """A child burns 1 CPU-s and is waited; a grandchild burns 1.5 CPU-s after its parent exited without waiting
    for it (re-parented out of the tree: getrusage(RUSAGE_CHILDREN) never counts it). The sampled sum holds both."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from vs_trl_lib.cpu_meter import run_measured

    done = tmp_path / "orphan_done"
    orphan = (f"import os, time\nif os.fork():\n    time.sleep(0.5)\n    os._exit(0)\n{BURN.format(s=1.5)}"
              f"open({str(done)!r}, 'w').close()\ntime.sleep(1.0)\n")
    script = (f"import os, subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {BURN.format(s=1.0)!r}])\n"
              f"subprocess.run([sys.executable, '-c', {orphan!r}])\nt = time.time()\n"
              f"while not os.path.exists({str(done)!r}) and time.time() - t < 60: time.sleep(0.05)\n")
    m = run_measured([sys.executable, "-c", script], env={}, cwd=str(tmp_path), log_path=tmp_path / "log",
                     interval=0.1)
    assert m.rc == 0 and done.exists(), (tmp_path / "log").read_text()
    assert m.cpu_s >= 2.2, m  # 1.0 + 1.5, less what a sample interval may miss
    assert m.rusage_children_cpu_s < 2.0, m  # the cross-check misses the orphan: why the meter samples



def test_a_variant_of_our_side_reaches_the_config_and_the_launch(tmp_path):
    """--ranks / --ours-args measure a variant: the extra trainer arguments go into the config the bench counts
    groups with (train_batch_groups) as into the run; bad values are refused before anything runs. (In a child
    process: the bench puts bench/ on sys.path.)"""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import vs_trl\n"
            "a = vs_trl.parse_args(sys.argv[1:]); c = vs_trl.demo_cfg(a)\n"
            "print(json.dumps([a.ranks, a.ours_args, c.train_batch_groups, c.Q_batch_size]))")
    run = lambda *argv: subprocess.run([sys.executable, "-c", code, "--run-dir", str(tmp_path), *argv], cwd=REPO,
                                       capture_output=True, text=True, timeout=120)
    out = run("--ranks", "1", "--ours-args", "--train_batch_groups 8 --Q_batch_size 16")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [1, ["--train_batch_groups", "8", "--Q_batch_size", "16"], 8, 16]
    out = run()
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])[:2] == [None, []], out.stderr
    out = run("--ranks", "0")
    assert out.returncode == 2 and "--ranks must be >= 1" in out.stderr.splitlines()[-1]
    out = run("--smoke", "--ours-args", "--gen_backend vllm")  # the smoke's HF worker, unless asked otherwise
    assert json.loads(out.stdout.splitlines()[-1])[:2] == [1, ["--gen_backend", "hf", "--gen_backend", "vllm"]]


def test_both_trl_settings_are_compared_and_the_cpu_is_named(monkeypatch):
    """Issue 62: one run reports ours against TRL at 1 and at 2 threads (both ratios, both walls), on a CPU it
    names with its kernel flags and caps; TRL's side runs in this Python where it has the pinned trl 1.16."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import vs_trl
    from vs_trl_lib.machine import cpu_info
    from vs_trl_lib.report import comparisons

    assert vs_trl.parse_args(["--run-dir", "x"]).trl_threads == [1, 2]
    assert vs_trl.parse_args(["--run-dir", "x", "--smoke"]).trl_threads == [1]
    side = lambda steps, spread, wall, **kw: dict(steps_per_cpu_s=steps, spread_groups_per_cpu_s=spread,  # noqa: E731
                                                  wall_s=wall, **kw)
    runs = {"trl_1t": side(0.4, 2.0, 690.0, threads=1), "trl_2t": side(0.5, 0.0, 514.0, threads=2),
            "ours": side(0.2, 1.0, 689.0)}
    c = comparisons(runs)
    assert c[1] == dict(steps_per_cpu_s_ratio=0.5, spread_groups_per_cpu_s_ratio=0.5, wall_ratio=689.0 / 690.0,
                        wall_s_trl=690.0, wall_s_ours=689.0)
    assert c[2]["steps_per_cpu_s_ratio"] == 0.4 and c[2]["spread_groups_per_cpu_s_ratio"] is None
    assert c[2]["wall_s_trl"] == 514.0
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    info = cpu_info()
    assert info["model"] and info["caps"] == {"ATEN_CPU_CAPABILITY": "avx2"} and "float32" in info["bf16"]
    assert set(info["flags"]) <= set(info["all_flags"])
    from importlib import metadata
    if metadata.version("trl") == "1.16.0":  # the project's pin: no second environment to create
        assert vs_trl.trl_python(vs_trl.parse_args(["--run-dir", "x", "--smoke"])) == Path(sys.executable)
