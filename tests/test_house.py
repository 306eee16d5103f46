"""The house rules of issue 64 that a scan can check: bench/'s scripts import no circle (sibling-script imports
included, as a script run from bench/ sees them), none is named like a project package (it would shadow it for
every script run from bench/), `free_port` is defined once outside tests/, no module in common/, ref_server/,
trainer/ or bench/ is over 330 lines (small files, one concern each), and names say what a module holds: no `X.py`
beside an `Xs/` package (the DeepSpeed policy was trainer's `engine.py` beside the generation engines/), no
`loop.py` or `cli.py` twice."""
from __future__ import annotations

import ast
from pathlib import Path

from test_imports import PACKAGES, REPO, find_cycles, imports_of

BENCH = REPO / "bench"
MAX_LINES = 330


def bench_modules() -> dict[str, Path]:
    """bench/'s modules by the names its scripts import them as (bench/ is first on their sys.path)."""
    mods = {}
    for path in sorted(BENCH.rglob("*.py")):
        parts = list(path.relative_to(BENCH).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def test_bench_imports_no_circle() -> None:
    mods = bench_modules()
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert "generation" in graph["agent_endpoint"], "the walk missed a sibling-script import: it is broken"
    assert "bench_lib.relay" in graph["weight_sync"] and "bench_lib.relay" in graph["weight_sync_file"]
    assert find_cycles(graph) == []


def test_no_bench_script_shadows_a_package() -> None:
    assert not [p.name for p in BENCH.glob("*.py") if p.stem in PACKAGES]


def test_free_port_defined_once_outside_tests() -> None:
    where = []
    for folder in (*PACKAGES, "bench", "scripts", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef) and node.name == "free_port":
                    where.append(str(path.relative_to(REPO)))
    assert where == ["common/listen.py"]


def test_no_module_over_the_line_limit() -> None:
    long = {}
    for folder in (*PACKAGES, "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(REPO))] = n
    assert long == {}


def test_names_say_what_a_module_holds() -> None:
    beside, seen = [], {"loop.py": [], "cli.py": []}
    for folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            if (path.parent / f"{path.stem}s").is_dir():
                beside.append(str(path.relative_to(REPO)))
            if path.name in seen:
                seen[path.name].append(str(path.relative_to(REPO)))
    assert beside == [], "a module named like the package beside it"
    assert seen == {"loop.py": ["trainer/loop.py"], "cli.py": ["trainer/demo/cli.py"]}
