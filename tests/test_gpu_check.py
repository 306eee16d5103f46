"""bench/gpu_check.py on CPU (issue 43): its smallest run (--smoke: the update probe, the HF reference loop and one
real `launch.sh train` run, ZeRO-3 with micro-batches and padding_free, the one that saves a checkpoint) writes each
result into --work as it finishes and ends with the probes' JSON line; and a deadline too short for anything still
ends on time with every result written, cut ones said so."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import REPO, qwen_vocab_dir, subprocess_env

pytestmark = pytest.mark.slow
CHECK = str(REPO / "bench" / "gpu_check.py")


@pytest.fixture(scope="module")
def models(request):
    """The check's CPU model (its --smoke shape), built once in pytest's cache (as conftest's qwen_instruct_dir) and
    passed as --models, instead of once per test in each --work: building the real-vocabulary checkpoint is not what
    either test checks (tests/test_qwen_vocab.py does), and it is not under the check's deadline."""
    with pytest.MonkeyPatch.context() as mp:  # bench/ off the path again after (kept off: bench/ first shadows)
        mp.syspath_prepend(str(REPO / "bench"))
        from gpu_check import SIZES
    return qwen_vocab_dir(request, "instruct", **SIZES["cpu"]).parent


def run_check(tmp_path, models, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict, float]:
    t = time.time()
    proc = subprocess.run([sys.executable, CHECK, "--smoke", "--work", str(tmp_path), "--models", str(models), *args],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1]), time.time() - t


def read(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_smoke_run_reports_every_figure_and_the_probes(tmp_path, models):
    proc, last, _ = run_check(tmp_path, models, "--deadline", "840", timeout=900)
    assert proc.returncode == 0 and last["ok"], proc.stderr[-4000:]
    assert last["zero3_vs_zero2_rel_diff"] <= 1e-3 and last["zero3_vs_zero2_ok"]
    assert "logp_mismatch_max" in last and "lockstep" in last["lockstep"]  # no vLLM run at smoke size: None, said so
    assert last["logp_mismatch_max"] is None and last["logp_mismatch_max_note"]
    probe = read(tmp_path, "probe-update")
    assert probe["optimizer_steps"] == [1, 1] and probe["update_norm"] > 0 and probe["lr"] >= 1e-3
    hf = read(tmp_path, "probe-hf")
    assert hf["tokens_per_s"] > 0 and hf["mfu"] is None and hf["mfu_note"]  # no data-sheet peak for a CPU
    versions = read(tmp_path, "versions")
    assert versions["torch"] and versions["transformers"] and versions["deepspeed"] and "vllm" in versions
    r = read(tmp_path, "variant-zero3_micro_packed")
    assert r["ok"] and r["steps_done"] == 2 and not r["cut"], r
    assert r["s_per_step"] > 0 and r["train_tokens_per_s"] > 0 and 0 <= r["wait_share"] <= 1
    assert r["gen_tokens_per_s"] > 0 and r["engine"] == "hf" and r["padding_share"] is not None
    assert r["sync_s"] is not None and r["rank0_max_memory_allocated_mib"] > 0
    assert set(r["measured_peak_mib"]) == {"rank0", "ref_server", "worker0"}, r["measured_peak_mib"]
    assert r["estimate_gib"]["rank0"] > 0 and r["estimate_gib"]["ref_server"] > 0, r["estimate_lines"]
    assert {"ds", "final"} <= set(r["checkpoint_dirs"])  # the check's one checkpoint
    assert read(tmp_path, "summary") == last


def test_a_deadline_too_short_cuts_and_still_reports(tmp_path, models):
    proc, last, wall = run_check(tmp_path, models, "--deadline", "25", timeout=300)
    assert proc.returncode == 1 and not last["ok"], proc.stderr[-3000:]
    assert wall < 25 + 60, wall  # the deadline, plus the interpreter's start and the cut processes' exit under load
    r = read(tmp_path, "variant-zero3_micro_packed")
    assert r["cut"] and not r["ok"] and r["error"]
    assert last["runs_cut"] == ["zero3_micro_packed"] and last["runs_ok"] == []
    probe = read(tmp_path, "probe-update")  # cut, or (an idle machine) done in time: either way a file
    assert probe.get("cut") or probe["zero3_vs_zero2_rel_diff"] <= 1e-3
