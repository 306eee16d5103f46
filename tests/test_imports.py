"""The project's import graph has no circles, every module imports on its own, and docs/architecture.md's
paths exist.

The graph counts every import statement, lazy ones inside functions too: a lazy import only hides a circle
until the day someone moves it to the top of the file.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "ref_server", "trainer")


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its file (`from a import b` may name module a.b)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in mods and m != name}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_find_cycles_sees_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    mods = project_modules()
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert graph["trainer.loop"], "the import walk found nothing: it is broken, not the code clean"
    assert find_cycles(graph) == []


def test_imports_only_go_downward() -> None:
    """common/ never imports trainer/ or ref_server/ (they import it); engines and rewards never import the loop."""
    mods = project_modules()
    for name, path in mods.items():
        deps = imports_of(name, path, mods)
        if name.startswith("common"):
            assert not {d for d in deps if d.startswith(("trainer", "ref_server"))}, name
        if name.startswith(("trainer.engines", "trainer.rewards")):
            assert "trainer.loop" not in deps, name
        if not name.startswith("trainer.demo"):
            assert not {d for d in deps if d.startswith("trainer.demo")}, f"{name} imports the demo (above it)"


def third_party_imports(mods: dict[str, Path]) -> list[str]:
    """The import statements of other packages (torch, transformers, the standard library...) that the project's
    modules run when imported: module level only (also inside a top-level if/try), not the lazy ones in functions."""
    def top(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, (ast.If, ast.Try)):
                yield from top(node.body)
                yield from top(node.orelse)
    found = set()
    for path in mods.values():
        for node in top(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                found.update(f"import {a.name}" for a in node.names if a.name.split(".")[0] not in PACKAGES)
            elif node.level == 0 and node.module.split(".")[0] not in (*PACKAGES, "__future__"):
                found.add(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    return sorted(found)


def test_every_module_imports_alone() -> None:
    """Each module imported first in a fresh interpreter (an import order that hides a circle fails here).

    One interpreter imports the other packages once, then forks a child per module: each child starts with no
    project module imported, which is all "alone" needs, without paying torch's import ~170 times. What the
    parent imports is what the project's modules import at module level anyway (third_party_imports: torch,
    transformers' masking_utils...), so a child pays only for the project's own code (before, with only the top
    packages preloaded, each child re-imported transformers' submodules: ~34 CPU-s of 36)."""
    mods = project_modules()
    names = [n for n in mods if not n.endswith("__main__")]
    shared = third_party_imports(mods)
    assert "import torch" in shared and not [s for s in shared if s.split()[1].split(".")[0] in PACKAGES]
    script = ("import importlib, json, os, sys, traceback\n"
              "for line in json.loads(sys.argv[1]):  # other packages only: shared by the forks\n"
              "    try:\n"
              "        exec(line, {})\n"
              "    except Exception:  # the module that needs it fails in its own child, with its own traceback\n"
              "        pass\n"
              "assert not [m for m in sys.modules if m.split('.')[0] in ('common', 'trainer', 'ref_server')]\n"
              "bad = []\n"
              "for n in sys.argv[2:]:\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        try:\n"
              "            importlib.import_module(n)\n"
              "        except BaseException:\n"
              "            print(n, traceback.format_exc().strip().splitlines()[-1], flush=True)\n"
              "            os._exit(1)\n"
              "        os._exit(0)\n"
              "    if os.waitpid(pid, 0)[1]:\n"
              "        bad.append(n)\n"
              "print('failed:', bad)\n"
              "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(shared), *names], cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


def test_following_one_batch_paths_exist() -> None:
    """docs/architecture.md ("Following one batch", moved there from the README) names only paths that exist."""
    text = (REPO / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:common|ref_server|trainer|bench|tests|configs|docs|scripts)/[\w./-]+)", text))
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (REPO / p.rstrip("/").split(":")[0]).exists())
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"
