"""Every bench/*.py runs at its --smoke size, so a landed change cannot break a benchmark unnoticed (issue 41).

The benches are found by a glob, so a new one is run without being listed here. Each runs as a user runs it:
`.venv/bin/python bench/NAME.py --smoke` from the checkout, in its own process, under a time limit; it must exit 0
and its last stdout line must be one JSON object (the bench convention, CONTRIBUTING.md). A bench that cannot run
offline on a CPU (it needs the package registry, a GPU or TRL) says so with a module-level string constant
`SMOKE_EXEMPT = "why"`, read here from the source (ast, nothing imported), and its --help must print that reason.
A smoke run that exits 77 (the automake convention) is skipped with its last line as the reason: a bench that runs
on a CPU but needs what this machine may lack (bench/multihost_step.py: root, for network namespaces).
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

BENCHES = sorted((REPO / "bench").glob("*.py"))
PYTHON = REPO / ".venv" / "bin" / "python"
SMOKE_TIMEOUT = 300  # s; a smoke run takes seconds to ~a minute idle, 2-4x that on a loaded 2-core box
# Rewritten with a --smoke size on another branch; skipped only while this checkout's copy has none.
# benches whose --smoke run a test of their own makes and reads further: run once, there
SMOKE_ELSEWHERE = {"gpu_check.py": "tests/test_gpu_check.py"}
SKIPPED = 77  # exit status of a smoke run this machine cannot host; its last stdout line says why


def python() -> str:
    return str(PYTHON) if PYTHON.exists() else sys.executable


def smoke_exempt(path: Path) -> str | None:
    """The bench's module-level SMOKE_EXEMPT string, or None."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "SMOKE_EXEMPT" for t in targets):
            why = ast.literal_eval(node.value)
            assert isinstance(why, str) and why.strip(), f"{path.name}: SMOKE_EXEMPT must be a non-empty string"
            return why
    return None


def words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def run(bench: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([python(), str(bench.relative_to(REPO)), *args], cwd=REPO, env=subprocess_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{bench.name} {' '.join(args)} ran past {timeout:.0f} s; stdout tail: {out[-2000:]}")


def test_benches_are_found():
    assert len(BENCHES) >= 10 and (REPO / "bench" / "weight_sync.py") in BENCHES, BENCHES


@pytest.mark.slow
@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_bench_runs_at_smoke_size(bench: Path):
    source = bench.read_text()
    why = smoke_exempt(bench)
    if why is not None:
        help_run = run(bench, "--help", timeout=120)
        assert help_run.returncode == 0, f"{bench.name} --help: rc {help_run.returncode}\n{help_run.stderr[-2000:]}"
        assert words(why) in words(help_run.stdout), f"{bench.name} --help does not say why it has no smoke run: {why}"
        pytest.skip(f"{bench.name}: {why}")
    if bench.name in SMOKE_ELSEWHERE:
        test = REPO / SMOKE_ELSEWHERE[bench.name]
        assert "--smoke" in source and "--smoke" in test.read_text(), f"{test} no longer runs {bench.name} --smoke"
        pytest.skip(f"{bench.name} --smoke runs in {SMOKE_ELSEWHERE[bench.name]}")
    proc = run(bench, "--smoke", timeout=SMOKE_TIMEOUT)
    if proc.returncode == SKIPPED:
        pytest.skip(f"{bench.name}: {(proc.stdout.strip().splitlines() or ['exit 77'])[-1]}")
    tail = f"\nstdout tail:\n{proc.stdout[-1500:]}\nstderr tail:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{bench.name} --smoke exited {proc.returncode}{tail}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{bench.name} --smoke printed nothing{tail}"
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        pytest.fail(f"{bench.name} --smoke: the last stdout line is not JSON ({e}): {lines[-1][:300]}{tail}")
    assert isinstance(result, dict) and result, f"{bench.name} --smoke: the last line is not a JSON object{tail}"
