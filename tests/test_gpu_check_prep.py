"""The CPU side of the GPU check (bench/gpu_check_wheels.py): which wheels are carried to the bare GPU machine,
and the one command that installs them there and runs the check. No network (gathering itself downloads)."""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check_wheels", REPO / "bench" / "gpu_check_wheels.py")
gw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gw)

REQS = (REPO / "requirements.txt").read_text()


def test_wheels_cover_our_runtime_pins_minus_the_preinstalled_closure():
    ship = gw.to_ship(REQS)
    pins = gw.pins(REQS)
    have = gw.closure(gw.PREINSTALLED) & gw.image_packages()
    for name in ("deepspeed", "bottle", "waitress", "math-verify"):  # the list
        assert ship[name] == pins[name]
    for name, version in pins.items():  # every runtime pin is either preinstalled there or carried, at our pin
        if name not in gw.NOT_SHIPPED:
            assert name in have or ship.get(name) == version, name
    assert not set(ship) & have  # nothing that would shadow the machine's own torch/transformers stack
    assert {"torch", "transformers", "peft", "accelerate", "safetensors", "tokenizers"} <= have
    assert {"pytest", "ruff", "datasets"}.isdisjoint(ship)
    # deepspeed's own dependencies come along unless the machine has them
    assert {"hjson", "py-cpuinfo", "ninja", "msgpack", "einops"} <= set(ship)


def test_closure_follows_requirements_and_target_markers():
    meta = {"a": ["b>=1", "c; python_version < '3.12'", "d; extra == 'dev'", "e; sys_platform == 'win32'"],
            "b": ["f"], "c": [], "d": [], "e": [], "f": []}
    assert gw.closure(["a"], meta.get) == {"a", "b", "f"}  # c: not on 3.12; d: an extra; e: not Linux


def test_to_ship_subtracts_the_preinstalled_closure():
    reqs = "deepspeed==1.0\nbottle==2.0\npytest==9.0\nnumpy==3.0\n"
    meta = {"deepspeed": ["numpy", "hjson", "torch"], "bottle": [], "hjson": [], "numpy": [], "pytest": [],
            "torch": ["numpy"], "transformers": ["numpy"], "peft": [], "accelerate": []}
    ship = gw.to_ship(reqs, meta.get, version=lambda n: {"hjson": "3.1"}.get(n, "x"),
                      image={"numpy", "torch", "transformers", "peft", "accelerate"})
    assert ship == {"bottle": "x", "deepspeed": "x", "hjson": "3.1"}  # numpy comes with torch, pytest not shipped


def test_only_what_the_image_names_counts_as_there():
    """The first GPU run (2026-11-28) stopped on `No module named 'pydantic'`: this venv's typer (pulled by the
    preinstalled transformers) needs pydantic, the image's typer does not, so the image has no pydantic; and a
    package the image holds is not followed into what this venv's copy of it needs."""
    reqs = "deepspeed==1.0\ntokenizers==0.1\n"
    meta = {"deepspeed": ["pydantic", "torch"], "pydantic": ["pydantic-core"], "pydantic-core": [],
            "tokenizers": ["huggingface-hub"], "huggingface-hub": ["httpx2"], "httpx2": [],
            "torch": [], "transformers": ["typer", "huggingface-hub"], "typer": ["pydantic"],
            "peft": [], "accelerate": []}
    image = {"torch", "transformers", "typer", "huggingface-hub", "peft", "accelerate"}
    ship = gw.to_ship(reqs, meta.get, version=lambda n: "x", image=image)
    assert ship == {"deepspeed": "x", "pydantic": "x", "pydantic-core": "x", "tokenizers": "x"}
    assert {"pydantic", "pydantic-core", "typing-inspection", "annotated-types"} <= set(gw.to_ship(REQS))
    assert {"torch", "numpy", "typer", "huggingface-hub"} <= gw.image_packages()


def test_another_target_python_changes_markers_and_tags():
    assert gw.closure(["a"], {"a": ["c; python_version < '3.12'"], "c": []}.get, py="3.11") == {"a", "c"}
    assert gw.fits_target("tiktoken-0.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", py="3.11")


def test_wheel_tags_must_fit_the_target():
    assert gw.fits_target("bottle-0.13.4-py2.py3-none-any.whl")
    assert gw.fits_target("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert gw.fits_target("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl")
    assert gw.fits_target("ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert not gw.fits_target("tiktoken-0.14.0-cp311-cp311-manylinux_2_28_x86_64.whl")  # this box's Python
    assert not gw.fits_target("foo-1.0-cp312-cp312-linux_x86_64.whl")  # built here, not manylinux
    assert not gw.fits_target("foo-1.0-cp312-cp312-macosx_11_0_arm64.whl")


def test_the_one_command_installs_offline_then_runs_the_check():
    cmd = gw.install_and_run()
    assert cmd == "python3 bench/gpu_check.py --wheels .whl"  # bench/gpu_check.py installs them, within its deadline
    assert gw.install_and_run(["--deadline", "300"]).endswith("bench/gpu_check.py --wheels .whl --deadline 300")
    out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "bench" / "gpu_check_wheels.py"),
                          "command"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == cmd
    other = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "bench" / "gpu_check_wheels.py"),
                            "command", "--python", "/opt/py/bin/python", "--", "--device", "cpu", "--smoke"],
                           capture_output=True, text=True, timeout=60, cwd=REPO).stdout.strip()
    assert other == "/opt/py/bin/python bench/gpu_check.py --wheels .whl --device cpu --smoke"


def test_wheel_dir_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", ".whl/x.whl"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, "the gathered wheels must not be committed"


@pytest.mark.skipif(not os.environ.get("GRPO_NETWORK_TESTS"),
                    reason="downloads from PyPI (set GRPO_NETWORK_TESTS=1 to run; not in CI)")
def test_gather_downloads_every_wheel_within_budget(tmp_path):
    ship = gw.to_ship(REQS)
    m = gw.gather(tmp_path / "whl", ship)
    assert set(ship) == {gw.name_of(f) for f in m["files"]}
    assert m["total_bytes"] <= gw.MAX_BYTES and all(gw.fits_target(f) for f in m["files"])
