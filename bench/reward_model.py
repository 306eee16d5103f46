"""Reward-model scoring benchmark (not a test; issue 44). The last line is one JSON object.

    .venv/bin/python bench/reward_model.py            # Qwen2.5-0.5B's shape, 4 of its 24 layers (CPU time)
    .venv/bin/python bench/reward_model.py --smoke    # seconds

Served: a real ref server process (`python -m ref_server --reward_models ...`) holds a random-weight
Qwen2ForSequenceClassification and scores each group of completions in one POST /reward (what every producer
sends: rows sorted by length, forwards of at most score_token_budget padded tokens). In-process: the same model
loaded in this process scores one completion at a time (each producer loading its own copy, no batching).
Both sides: fp32 on CPU, one torch thread (the server via OMP_NUM_THREADS), the same texts (the tiny model's
chat template and tokenizer: the tokenizer does not change the forward's cost; the model has Qwen2.5-0.5B's hidden
896, 14/2 heads, intermediate 4864 and 151,936-token vocabulary). Reported: `speedup` = in-process seconds /
served seconds (best of --repeats for each), and the two scores' largest difference (they must agree).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.wire.client import RefClient  # noqa: E402

QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
               vocab_size=151936, max_position_embeddings=4096)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="Decoder layers (Qwen2.5-0.5B has 24; CPU time).")
    p.add_argument("--groups", type=int, default=2, help="Groups scored (one request each when served).")
    p.add_argument("--group-size", type=int, default=8, help="Completions per group (num_pre_Q).")
    p.add_argument("--min-words", type=int, default=20, help="Shortest completion, in words.")
    p.add_argument("--max-words", type=int, default=200, help="Longest completion, in words.")
    p.add_argument("--repeats", type=int, default=2, help="Runs of each side; the best counts.")
    p.add_argument("--smoke", action="store_true", help="A tiny model and batch: runs in seconds.")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.groups, a.group_size, a.min_words, a.max_words, a.repeats = 1, 2, 4, 4, 24, 1
    return a


def build_model(folder: Path, layers: int, smoke: bool) -> None:
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from common.modeling import resolve_model_path
    src = resolve_model_path("tiny")
    d = AutoConfig.from_pretrained(src).to_dict()
    for k in ("layer_types", "id2label", "label2id"):  # rebuilt for the layer count and the one label
        d.pop(k, None)
    d.update({} if smoke else QWEN05B, num_hidden_layers=layers, num_labels=1,
             architectures=["Qwen2ForSequenceClassification"])
    c = Qwen2Config(**d)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(c).save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)


def make_groups(a) -> list[tuple[list, list[str]]]:
    rng = random.Random(0)
    words = "the a number is answer so we add then three seven twelve because step first next".split()
    return [([{"role": "user", "content": f"Question {g}: what is {g} + {g}?"}],
             [" ".join(rng.choice(words) for _ in range(rng.randint(a.min_words, a.max_words)))
              for _ in range(a.group_size)]) for g in range(a.groups)]


def in_process(folder: Path, groups) -> tuple[float, list[float]]:
    from ref_server.reward_models import RewardModels

    models = RewardModels.load([{"path": str(folder), "name": "rm", "tokenizer": None}], torch.device("cpu"),
                               torch.float32)
    t0, out = time.perf_counter(), []
    for prompt, comps in groups:
        for c in comps:  # one completion at a time, as a producer with its own copy scoring as it goes
            out += models.score("rm", [prompt], [c])
    return time.perf_counter() - t0, out


def start_server(folder: Path, port: int, token_file: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "ref_server", "--model", "tiny", "--port", str(port), "--device", "cpu",
           "--token-file", str(token_file), "--reward_models", json.dumps([{"path": str(folder), "name": "rm",
                                                                              "tokenizer": None}])]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    groups = make_groups(a)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "rm"
        build_model(folder, a.layers, a.smoke)
        (Path(tmp) / "token").write_text("bench")
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(folder, port, Path(tmp) / "token", Path(tmp) / "server.log")
        try:
            client = RefClient(f"http://127.0.0.1:{port}", token="bench", timeout=600)
            if not client_ready(client, server):
                print((Path(tmp) / "server.log").read_text()[-3000:], file=sys.stderr)
                return 1
            served_s, local_s = [], []
            for _ in range(a.repeats):  # alternating, so that a load spike hits both sides
                t0 = time.perf_counter()
                served = [v for prompt, comps in groups
                          for v in client.reward_scores("rm", [prompt] * len(comps), comps, timeout=600)]
                served_s.append(time.perf_counter() - t0)
                dt, local = in_process(folder, groups)
                local_s.append(dt)
        finally:
            server.terminate()
            server.wait(timeout=60)
    diff = max(abs(x - y) for x, y in zip(served, local))
    n = a.groups * a.group_size
    result = {"bench": "reward_model", "smoke": a.smoke, "layers": a.layers, "shape": "tiny" if a.smoke else
              "Qwen2.5-0.5B", "completions": n, "served_s": round(min(served_s), 3),
              "in_process_s": round(min(local_s), 3), "speedup": round(min(local_s) / min(served_s), 3),
              "max_abs_diff": diff}
    print(f"{n} completions: served (one request per group of {a.group_size}) {min(served_s):.2f} s, "
          f"in-process one at a time {min(local_s):.2f} s")
    print(json.dumps(result))
    return 0 if diff < 1e-3 else 1


def client_ready(client: RefClient, server: subprocess.Popen, timeout: float = 600) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            client.reward_scores("rm", ["x"], ["y"], timeout=60)
            return True
        except Exception:  # noqa: BLE001 - not listening yet (the model loads): poll again
            time.sleep(0.5)
    return False


if __name__ == "__main__":
    code = main()
    from common.fast_exit import exit_cleanly  # done: skip the interpreter's teardown (~1-2 CPU-s after torch)
    exit_cleanly(code)
