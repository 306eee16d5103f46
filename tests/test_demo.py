"""End to end: the README's demo command in its --quick (CI-sized) form.

Runs `./launch.sh demo --quick`: tiny model -> a few SFT steps -> eval -> GRPO through the real
pipeline (ref server, a genonly worker, deepspeed with 2 CPU ranks) -> eval, then checks
summary.json, the plot, the logs, and that no process of the run is left behind.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, run_process_group, subprocess_env

from common.config import GRPOConfig


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (not zombies) that contain `text`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(f"{d.name}: {cmd}")
    return found


def test_demo_help() -> None:
    out = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "trainer.demo", "--help"], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for opt in ("--run-dir", "--seed", "--quick", "--model", "--data"):
        assert opt in out.stdout


def test_paths_are_the_callers(tmp_path: Path, monkeypatch) -> None:
    """launch.sh runs the demo from the checkout: its run folder (default runs/demo-<time>), --config and a --model
    or --data that names something there are taken from where the user ran it (as `launch.sh train` does), not
    written into / read from the checkout; a hub id stays a hub id."""
    from trainer.demo.cli import DEMO_CONFIG, parse_args

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("GRPO_CALLER_DIR", str(tmp_path))
    (tmp_path / "my.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    a, _ = parse_args([])
    assert Path(a.run_dir).parent == tmp_path / "runs" and Path(a.run_dir).name.startswith("demo-")
    assert a.config == str(DEMO_CONFIG)
    a, _ = parse_args(["--run-dir", "out", "--config", "my.json", "--model", "ckpt", "--data", "./d.jsonl"])
    assert (a.run_dir, a.config, a.model, a.data) == tuple(str(tmp_path / n) for n in ("out", "my.json", "ckpt",
                                                                                       "./d.jsonl"))
    a, _ = parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--data", "openai/gsm8k"])
    assert (a.model, a.data) == ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k")


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo run"  # a space in the path: every process must quote it
    t0 = time.time()
    proc = run_process_group([str(REPO / "launch.sh"), "demo", "--quick", "--seed", "3", "--run-dir", str(run_dir)],
                             cwd=REPO, env=subprocess_env(), timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for banner in ("1/5", "2/5", "3/5", "4/5", "5/5", "accuracy", "format"):
        assert banner in proc.stdout, out[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "format_before", "format_after"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary)
    assert summary["steps"] == 6 and summary["seed"] == 3
    assert 0 < summary["wall_seconds"] <= time.time() - t0 + 1

    png = run_dir / "plot.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    grpo = run_dir / "grpo"
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, 7))
    assert any("eval_accuracy" in r for r in rows)
    assert all(r["kl"] >= 0 for r in rows if "kl" in r)
    assert (grpo / "final" / "config.json").is_file()
    # --quick: a quarter of a step's work, the same plumbing; one CPU rank takes two ranks' groups (ranks auto)
    from common.placement.cpu_ranks import auto_cpu_ranks
    from common.placement.gen_choice import choose_gen_backend
    from common.settings.knobs import load_config
    ranks = auto_cpu_ranks(load_config(GRPOConfig, ["--config", str(REPO / "configs" / "demo.json")]))[0]
    cfg = json.loads((grpo / "config.json").read_text())
    assert (cfg["Q_batch_size"], cfg["train_batch_groups"], cfg["num_pre_Q"]) == (2, 2 // ranks, 8), cfg
    notes = json.loads((grpo / "placement.json").read_text())["notes"]
    assert any(n.startswith(f"ranks auto: {ranks} ") for n in notes), notes
    # configs/demo.json's bf16 / vllm_dtype / gen_backend auto, as resolved on this CPU (issue 62), recorded and said
    from common.settings.precision import native_bf16
    native = native_bf16()[0]
    demo = load_config(GRPOConfig, ["--config", str(REPO / "configs" / "demo.json")])
    assert (cfg["bf16"], cfg["vllm_dtype"]) == (native, "bfloat16" if native else "float32"), cfg
    assert cfg["gen_backend"] == choose_gen_backend(demo, cuda=False)[0], cfg
    said = "precision: " + ("bfloat16" if native else "float32") + " (bf16 auto: "
    assert said in (grpo / "trainer.log").read_text() and said in (grpo / "worker0.log").read_text()
    for name in ("demo.log",):
        assert (run_dir / name).stat().st_size > 0
    for name in ("ref_server.log", "worker0.log", "trainer.log"):
        assert (grpo / name).stat().st_size > 0, name
    # the genonly worker really fed the server, and stopped cleanly when training ended
    done = re.search(r"worker done: \d+ rounds, (\d+) batches uploaded", (grpo / "worker0.log").read_text())
    assert done and int(done.group(1)) > 0, (grpo / "worker0.log").read_text()[-2000:]

    # nothing the demo started is still running (ref server, worker, ranks, launcher all gone)
    deadline = time.time() + 20
    while (left := _processes_mentioning(str(run_dir))) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, left
