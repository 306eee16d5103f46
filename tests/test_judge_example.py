"""The judge reward of docs/reward_models.md (issue 44), the very code block of the page, against a stand-in
OpenAI-compatible endpoint on 127.0.0.1: scores parsed from the replies, a slow reply and a down endpoint give None
within the timeout, and through RewardScorer a completion the judge could not score keeps its other rewards."""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class StandIn(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: the score is the answer's digit count (bad -> no number; slow -> sleeps)."""
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        answer = body["messages"][0]["content"].rsplit("Answer: ", 1)[1]
        if "slow" in answer:
            time.sleep(3)
        reply = "no idea" if "bad" in answer else str(sum(ch.isdigit() for ch in answer))
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the judge gave up on the slow reply (its timeout): expected

    def log_message(self, *args):
        pass


@pytest.fixture
def judge(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", (REPO / "docs" / "reward_models.md").read_text(), re.S).group(1)
    (tmp_path / "judge.py").write_text(code)
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("JUDGE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
    monkeypatch.setenv("JUDGE_TIMEOUT", "1")
    monkeypatch.setenv("JUDGE_API_KEY", "k")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("judge", None)
    import judge as module
    yield module, server
    server.shutdown()
    server.server_close()
    sys.modules.pop("judge", None)


def test_judge_scores_and_none_on_failure(judge):
    module, server = judge
    prompts = [[{"role": "user", "content": "What is 12 x 3?"}]] * 4
    completions = [[{"role": "assistant", "content": c}] for c in ("36", "1234567", "bad", "slow 1")]
    t0 = time.monotonic()
    assert module.judge(prompts=prompts, completions=completions) == [0.2, 0.7, None, None]
    assert time.monotonic() - t0 < 2.5  # the slow reply was cut at JUDGE_TIMEOUT (1 s), calls in parallel
    asked = StandIn.seen[-1]
    assert asked["path"] == "/v1/chat/completions" and asked["auth"] == "Bearer k" and asked["model"] == "judge"
    assert "Question: What is 12 x 3?" in asked["messages"][0]["content"]
    assert module.judge(prompts=["Q: 2+2?"], completions=["4"]) == [0.1]  # plain-text data
    server.shutdown()
    server.server_close()
    assert module.judge(prompts=["Q"], completions=["4"]) == [None]  # the endpoint is down


def test_judge_none_keeps_the_other_rewards(judge):
    from trainer.data.example import Example
    from trainer.rewards.scoring import RewardScorer

    scorer = RewardScorer(["judge:judge", "format"], timeout=0, conversational=True)
    try:
        score = scorer.score_group(Example(prompt=[{"role": "user", "content": "Q?"}], ground_truth="1"),
                                   ["<answer>12</answer>", "bad"])
    finally:
        scorer.close()
    assert score.components["judge"] == [0.2, None]
    assert score.rewards[1] == pytest.approx(score.components["format"][1])  # the None is left out of the sum
