"""What a run directory says about its run once it is over (issue 41): launch.sh records how it ended, and
`launch.sh status` reads it when the ref server is gone; checkpoints an interrupted save left half-written go.

    RUN_DIR/run.json      {"ref_url", "started"}: written by launch.sh when the run starts
    RUN_DIR/run_end.json  {"exit_code", "last_step", "final_model", "diagnosis", "ended"}: written on the way out

    python -m common.run_record start RUN_DIR REF_URL     (launch.sh)
    python -m common.run_record end RUN_DIR EXIT_CODE     (launch.sh's cleanup: also drops incomplete checkpoints)

No torch here: it runs in launch.sh's cleanup and in `launch.sh status`.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

END, START = "run_end.json", "run.json"
MEANING = {0: "done", 2: "a bad option or config", 3: "stalled, or a process it started exited",
           4: "a peer rank is gone", 5: "unusable batches", 6: "policy weights refused", 7: "nothing to train on",
           8: "no reward spread: nothing trains (max_no_spread_groups)",
           75: "stopped with a checkpoint for a requeue (SIGUSR1)", 130: "interrupted (Ctrl-C)",
           143: "stopped (SIGTERM)"}  # docs/hangs.md "Exit codes"


def last_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl recorded (None before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    step = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the interruption
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            step = row["step"]
    return step


def drop_incomplete(run_dir: Path) -> list[str]:
    """Remove what an interrupted save left looking like a checkpoint: DeepSpeed tags newer than ds/latest (it is
    written after the tag is complete) and HF directories still under their temporary `.partial` name
    (trainer/checkpoint.py renames them when complete). Returns what went."""
    gone = []
    ds = run_dir / "ds"
    if ds.is_dir():
        latest = (ds / "latest").read_text().strip() if (ds / "latest").is_file() else ""
        m = re.fullmatch(r"step(\d+)", latest)
        keep = int(m.group(1)) if m else -1
        for p in ds.iterdir():
            t = re.fullmatch(r"step(\d+)", p.name)
            if t and p.is_dir() and int(t.group(1)) > keep:
                shutil.rmtree(p, ignore_errors=True)
                gone.append(str(p))
    for p in run_dir.glob("*.partial"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(str(p))
    return gone


def write_start(run_dir: Path, ref_url: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / END).unlink(missing_ok=True)  # a new attempt in the same directory is not over yet
    (run_dir / START).write_text(json.dumps({"ref_url": ref_url, "started": time.strftime("%Y-%m-%d %H:%M:%S")}))


def write_end(run_dir: Path, code: int) -> dict:
    diag = run_dir / "diagnosis.txt"
    final = run_dir / "final"
    record = {"exit_code": code, "last_step": last_step(run_dir),
              "final_model": str(final.resolve()) if code == 0 and (final / "config.json").is_file() else None,
              "diagnosis": diag.read_text().strip().splitlines()[0] if diag.is_file() and diag.read_text().strip()
              else None, "dropped_incomplete": drop_incomplete(run_dir), "ended": time.strftime("%Y-%m-%d %H:%M:%S")}
    (run_dir / END).write_text(json.dumps(record, indent=2) + "\n")
    return record


def describe(run_dir: Path) -> str | None:
    """One line on how the run in run_dir ended (None when it has no end record)."""
    path = run_dir / END
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    code = r["exit_code"]
    step = "no step finished" if r.get("last_step") is None else f"last step {r['last_step']}"
    what = f"exit {code} ({MEANING.get(code, 'failed')})"
    tail = f"final model {r['final_model']}" if r.get("final_model") else (r.get("diagnosis") or "no final model")
    return f"run {run_dir} ended {r.get('ended', '?')}: {what}, {step}; {tail}"


def newest_run(folders: list[Path]) -> Path | None:
    """The run directory (with run.json) most recently started or ended among folders and their subfolders,
    one and two levels down (runs/<timestamp>)."""
    found = []
    for f in folders:
        for pattern in (START, f"*/{START}", f"*/*/{START}"):
            found += [p.parent for p in f.glob(pattern)]
    stamp = lambda d: max((d / n).stat().st_mtime for n in (START, END) if (d / n).is_file())
    return max(found, key=stamp, default=None)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "start":
        write_start(Path(argv[1]), argv[2])
        return 0
    if len(argv) == 3 and argv[0] == "end":
        record = write_end(Path(argv[1]), int(argv[2]))
        for p in record["dropped_incomplete"]:
            print(f"[launch] removed {p}: a checkpoint the interruption left incomplete", file=sys.stderr)
        return 0
    print(__doc__.split("\n\n")[2], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
