"""Dataset files: the rows of one file, and which file of a folder holds a split.

    .jsonl / .jsonl.gz        one JSON object per line (blank lines skipped)
    .json / .json.gz          a JSON array of objects, or JSON lines (what `datasets` writes with to_json)
    .csv                      a header line, then one row per line; every value is a string
    .parquet                  read with pyarrow, without touching the Hugging Face cache

Every row comes with where it came from ("file:line", "file:item 3", "file:row 3") for error messages; reading is
lazy where the format allows, so `limit` stops early on a large JSON-lines file.
"""
from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from common.settings.checks import DATA_FILE_SUFFIXES


def is_data_file(name: str | Path) -> bool:
    return str(name).lower().endswith(DATA_FILE_SUFFIXES)


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8", newline="")


def _json_line(line: str, where: str, path: Path) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        hint = ""
        if path.name.lower().endswith((".json", ".json.gz")):
            hint = "; a .json file holds a JSON array of rows or one JSON object per line"
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}){hint}") from e


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    may_be_array = path.name.lower().endswith((".json", ".json.gz"))
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if may_be_array and line.lstrip().startswith("["):  # a JSON array: the whole file is one document
                try:
                    rows = json.loads(line + f.read())
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno - 1 + e.lineno}: invalid JSON ({e.msg} at column {e.colno})") \
                        from e
                yield from ((f"{path}:item {i}", row) for i, row in enumerate(rows, 1))
                return
            may_be_array = False  # only the first row can open an array
            yield f"{path}:{lineno}", _json_line(line, f"{path}:{lineno}", path)


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        width = len(reader.fieldnames or [])
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or None in row.values():  # DictReader's marks for too many / too few fields
                n = width + len(row.get(None) or []) - sum(v is None for v in row.values())
                raise ValueError(f"{where}: {n} fields, but the header has {width}")
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; reads without touching the HF cache

    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield f"{path}:row {i}", row


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the file, in order."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _parquet_rows(path)
    if name.endswith(".csv"):
        return _csv_rows(path)
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return _json_rows(path)
    raise ValueError(f"{path}: unsupported file type (use {', '.join(DATA_FILE_SUFFIXES)})")


def split_file(directory: Path, split: str) -> Path:
    """{split}.<any supported suffix>, else one hub-style {split}-00000-of-00001.parquet shard."""
    found = [directory / f"{split}{s}" for s in DATA_FILE_SUFFIXES if (directory / f"{split}{s}").is_file()]
    if len(found) > 1:
        raise ValueError(f"{directory}: several files for split {split!r} ({', '.join(p.name for p in found)}); "
                         f"keep one")
    if found:
        return found[0]
    shards = sorted(directory.rglob(f"{split}-*.parquet"))
    if len(shards) == 1:
        return shards[0]
    if len(shards) > 1:
        raise ValueError(f"{directory}: several parquet shards for split {split!r} ({len(shards)}); "
                         f"merge them into {split}.parquet")
    raise FileNotFoundError(f"{directory}: no {split}.jsonl, .json, .csv or .parquet for split {split!r}")
