"""Pre-auth memory of the ref server (issue 23; not a test). Prints figures; the last line is one JSON object.

    .venv/bin/python bench/preauth_memory.py                       # 3 x 3 GiB, as in the issue
    .venv/bin/python bench/preauth_memory.py --requests 3 --gib 1

Starts a real ref server (tiny model, a token, 16 GiB for PUT /weights: a ~3B model's default), reads its
resident memory, then sends `--requests` header-only `PUT /weights` requests without a token, each
declaring `--gib` GiB, plus one never-ending chunked POST /upload without a token, keeping every
connection open. Reports the server's resident memory after each, the answers, the temp files it
holds open (waitress spools bodies there) and whether /health still answers. Before issue 23 the
declared length was allocated before the token check (the issue: 428 MB -> 5.9 GB for 3 x 3 GiB).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

from common.listen import free_port

REPO = Path(__file__).resolve().parent.parent


def rss_mb(p: psutil.Process) -> float:
    return round(p.memory_info().rss / 2**20, 1)


def spooled(p: psutil.Process) -> int:
    return sum(1 for f in p.open_files() if f.path.endswith("(deleted)") or "/#" in f.path)


def first_line(s: socket.socket, timeout: float) -> str:
    s.settimeout(timeout)
    try:
        return s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace") or "(closed)"
    except (TimeoutError, ConnectionResetError) as e:
        return f"(no answer: {type(e).__name__})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3, help="Header-only PUT /weights requests.")
    p.add_argument("--gib", type=float, default=3.0, help="Content-Length each declares, in GiB.")
    p.add_argument("--settle", type=float, default=2.0, help="Seconds to wait before reading memory.")
    p.add_argument("--smoke", action="store_true", help="The test suite's seconds-long run: 1 request of 1 GiB, "
                                                        "0.5 s settle.")
    a = p.parse_args()
    if a.smoke:
        a.requests, a.gib, a.settle = 1, 1.0, 0.5
    port, tmp = free_port(), tempfile.mkdtemp(prefix="preauth.")
    token_file = Path(tmp) / "token"
    token_file.write_text("bench-token-123456")
    log = open(Path(tmp) / "server.log", "wb")
    env = {**os.environ, "GRPO_REF_TOKEN": ""}
    proc = subprocess.Popen([sys.executable, "-m", "ref_server", "--model", "tiny", "--port", str(port),
                             "--token-file", str(token_file), "--device", "cpu", "--max-weights-mb", "16384"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, socks = f"http://127.0.0.1:{port}", []
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        server = psutil.Process(proc.pid)
        rss = [rss_mb(server)]
        print(f"server up: RSS {rss[0]} MB")
        answers = []
        for i in range(a.requests):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
            s.sendall(f"PUT /weights?version={i + 1} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Length: {int(a.gib * 2**30)}\r\n\r\n".encode())
            time.sleep(a.settle)
            answers.append(first_line(s, 1.0))
            rss.append(rss_mb(server))
            print(f"PUT /weights declaring {a.gib} GiB, no token: {answers[-1]!r}; RSS {rss[-1]} MB")
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(s)
        s.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + (b"10000\r\n" + b"\1" * 0x10000 + b"\r\n") * 16)
        time.sleep(a.settle)
        chunked = first_line(s, 1.0)
        n_spooled = spooled(server)
        print(f"chunked POST /upload (1 MiB sent, no end), no token: {chunked!r}; temp files open: {n_spooled}")
        try:
            health = requests.get(url + "/health", timeout=10).json()["status"]
        except requests.RequestException as e:
            health = f"no answer: {type(e).__name__}"
        print(f"/health: {health}; server alive: {proc.poll() is None}")
        result = {"bench": "preauth_memory", "requests": a.requests, "declared_gib": a.gib, "rss_mb": rss,
                  "rss_growth_mb": round(max(rss) - rss[0], 1), "put_answers": answers,
                  "chunked_answer": chunked, "spooled_files": n_spooled, "health": health,
                  "alive": proc.poll() is None}
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    shutil.rmtree(tmp)  # kept (with the server's log) only when the bench failed
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(0)
