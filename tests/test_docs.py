"""The docs say what ships: README.md's shape (size, sections in the issue's order, the two commands), every relative
link and anchor, every repository path the pages name, a generated configuration reference that is not stale, and
every flag of a documented command taken by its entry point's --help (GPU and multi-node commands are only parsed,
not run)."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
PATH_RE = re.compile(r"(?<![\w./$-])((?:common|ref_server|trainer|bench|tests|configs|docs|scripts|examples|\.ci)/"
                     r"[\w./-]*[\w/])")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def slugs(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, repeats numbered."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", md, flags=re.S)
    for h in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        s = re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_readme_is_short_and_in_the_issues_order() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 12000, len(text.encode())
    heads = re.findall(r"^## (.+)$", text, flags=re.M)
    words = ("Why", "Status", "Install", "Quickstart")
    where = [next((i for i, h in enumerate(heads) if w in h), None) for w in words]
    assert None not in where and where == sorted(where), heads
    ci = "CI (`.ci/run`) runs\n`ruff check .` and then exactly `./run_tests.sh`"
    for line in ("./launch.sh demo", "./run_tests.sh", ci):
        assert line in text, line
    ci_script = (REPO / ".ci" / "run").read_text()
    assert "ruff check ." in ci_script and "./run_tests.sh" in ci_script


def broken_links(text: str, here: Path) -> list[str]:
    """Relative links of a page in folder `here` whose file or heading does not exist."""
    bad = []
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        dest = (here / path).resolve() if path else None
        body = dest.read_text() if dest and dest.is_file() and dest.suffix == ".md" else text if not path else None
        if dest and not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and body is not None and anchor not in slugs(body):
            bad.append(f"{target}: no such heading")
    return bad


def missing_paths(text: str) -> list[str]:
    named = {m.split(":")[0] for m in PATH_RE.findall(text)}
    return sorted(p for p in named if not (REPO / p.rstrip("/")).exists())


def test_root_files_exist() -> None:
    assert "MIT License" in (REPO / "LICENSE").read_text()
    assert 'license = "MIT"' in (REPO / "pyproject.toml").read_text()
    assert (REPO / "CHANGELOG.md").is_file() and (REPO / "CONTRIBUTING.md").is_file()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_and_anchors_exist(page: Path) -> None:
    assert broken_links(page.read_text(), page.parent) == [], rel(page)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_paths_exist(page: Path) -> None:
    assert missing_paths(page.read_text()) == [], f"{rel(page)} names paths that do not exist"


def test_the_link_and_path_checks_find_what_is_missing() -> None:
    page = "# Top\n## A `b` c, d\n[x](gpus.md#memory-estimate) [y](#a-b-c-d) [z](#top) `trainer/main.py:main`\n"
    assert broken_links(page, REPO / "docs") == [] and missing_paths(page) == []
    page = "[x](gpus.md#no-such) [y](nosuch.md) [z](#nowhere) `trainer/no_such.py` see common/gone/x.py\n"
    assert broken_links(page, REPO / "docs") == ["gpus.md#no-such: no such heading", "nosuch.md: no such file",
                                                 "#nowhere: no such heading"]
    assert missing_paths(page) == ["common/gone/x.py", "trainer/no_such.py"]


def test_configuration_reference_is_generated_and_current() -> None:
    from common.config import GRPOConfig
    from ref_server.config import ServerConfig
    r = subprocess.run([sys.executable, "scripts/gen_config_docs.py", "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = (REPO / "docs" / "configuration.md").read_text()
    for cls in (GRPOConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc, f"{cls.__name__}.{f.name} is not in docs/configuration.md"


# --- commands the pages name: their entry points and flags ---------------------------------------------------------

LAUNCH_MODES = ("demo", "train", "check", "status", "ref-server", "trainer-host", "workers")
PY_ENTRIES = {"ref_server": ["-m", "ref_server"], "trainer.evaluate": ["-m", "trainer.evaluate"],
              "common.tiny_model": ["-m", "common.tiny_model"], "trainer/main.py": ["trainer/main.py"],
              "trainer.demo": ["-m", "trainer.demo"], "trainer.check": ["-m", "trainer.check"],
              "scripts/gen_config_docs.py": ["scripts/gen_config_docs.py"]}
AFTER_DASHES = {"ref-server": "ref_server"}  # where a launch.sh mode's arguments after `--` go (else: the trainer)


@cache
def help_flags(entry: str) -> frozenset[str]:
    """The flags an entry point's --help lists, dashes and underscores alike."""
    env = dict(os.environ, GRPO_PYTHON=sys.executable, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    if entry.startswith("launch.sh "):
        cmd = ["bash", "launch.sh", entry.split()[1], "--help"]
    else:
        cmd = [sys.executable, *PY_ENTRIES[entry], "--help"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-2000:]}"
    return frozenset(f.replace("_", "-") for f in re.findall(r"--[\w-]+", r.stdout))


def commands(text: str) -> list[str]:
    """Command lines: every line of a fenced block (continuations joined) and every inline code span that
    starts one of our entry points."""
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        out += [ln.strip().removeprefix("$ ") for ln in block.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    out += [s.replace("\n", " ") for s in spans if re.match(r"(\S*launch\.sh|\S*python3? )", s)]
    return out


def documented_flags(line: str) -> list[tuple[str, str]]:
    """(entry point, flag) for each flag given to one of our entry points on a command line."""
    line = line.split("#")[0] if not line.lstrip().startswith("#") else ""
    try:
        words = shlex.split(line.replace("[", " ").replace("]", " "))
    except ValueError:
        words = line.split()
    out = []
    for i, w in enumerate(words):
        if w.endswith("launch.sh") and i + 1 < len(words) and words[i + 1] in LAUNCH_MODES:
            mode, rest = words[i + 1], words[i + 2:]
            entry = f"launch.sh {mode}"
        elif re.fullmatch(r"\S*python3?", w) and i + 1 < len(words):
            target = words[i + 2] if words[i + 1] == "-m" and i + 2 < len(words) else words[i + 1]
            if target not in PY_ENTRIES:
                continue
            mode, rest, entry = None, words[i + (3 if words[i + 1] == "-m" else 2):], target
        else:
            continue
        for w2 in rest:
            if w2 in ("&&", "|", ";") or w2.endswith("launch.sh"):
                break
            if w2 == "--" and mode:
                entry = AFTER_DASHES.get(mode, "trainer/main.py")
            elif w2.startswith("--") and len(w2) > 2:
                out.append((entry, w2.split("=")[0]))
        break
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_documented_commands_parse(page: Path) -> None:
    wrong = []
    for line in commands(page.read_text()):
        for entry, flag in documented_flags(line):
            if flag.replace("_", "-") not in help_flags(entry) and flag not in ("--help", "-h"):
                wrong.append(f"{entry} {flag} (in: {line[:100]})")
    assert wrong == [], f"{rel(page)}: flags their entry points do not take: {wrong}"


def test_the_command_check_finds_a_wrong_flag() -> None:
    """The checker itself: a made-up flag on each kind of command is caught, a real one passes."""
    bad = ["./launch.sh train --run-dirx r -- --lr 1e-6", "./launch.sh train --run-dir r -- --lrx 1",
           "python -m trainer.evaluate --modelx m", "$G/launch.sh ref-server --host h -- --nosuch 1"]
    for line in bad:
        flags = documented_flags(line)
        assert any(f.replace("_", "-") not in help_flags(e) for e, f in flags), line
    good = "$G/launch.sh train --config my_config.json --run-dir runs/first -- --save_steps 100 --num_generations 4"
    assert all(f.replace("_", "-") in help_flags(e) for e, f in documented_flags(good))
