"""The heartbeat table on a real ref server: GET /status, GET /, POST /heartbeat, `launch.sh status`."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests
from conftest import REPO, subprocess_env
from test_ref_server import make_batch

from common.wire.client import RefClient, RefServerError
from ref_server.status import HeartbeatTable, format_table

TOKEN = "s3cret-status-token"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("status") / "token"
    token_file.write_text(TOKEN)
    with start_server(tiny_model_dir, "--stall-warn", "1.5", "--token-file", str(token_file)) as srv:
        srv.token_file = token_file
        yield srv


def client(srv, pid: str, role: str) -> RefClient:
    c = RefClient(srv.url, token=TOKEN, timeout=10)
    c.set_identity(pid, role, host="test-host")
    return c


def test_table_counts_uploads_gets_and_heartbeats(server):
    worker, rank = client(server, "worker7", "worker"), client(server, "trainer-rank0", "rank")
    worker.set_version(3)
    worker.upload(make_batch([3, 4], [2, 2]))
    worker.heartbeat("generating round 2", rounds=2, skipped_groups=5)
    assert rank.get(timeout=10) is not None
    rank.get(timeout=0)  # an empty /get still counts as a sign of life
    st = rank.status()
    rows = {r["id"]: r for r in st["participants"]}
    w, r = rows["worker7"], rows["trainer-rank0"]
    assert (w["role"], w["host"], w["version"], w["uploaded"], w["rounds"], w["skipped_groups"]) == \
        ("worker", "test-host", 3, 1, 2, 5)
    assert w["state"] == "generating round 2" and w["last_upload_ago_s"] is not None
    assert (r["role"], r["taken"], r["uploaded"]) == ("rank", 1, 0) and r["last_get_ago_s"] < 5
    assert st["queues"]["input"]["depth"] == 0 and "oldest_age_s" in st["queues"]["output"]
    assert st["weights"]["version"] is None and st["stall_warn"] == 1.5


def test_silent_participant_is_stalled_until_it_calls_again(server):
    c = client(server, "worker-silent", "worker")
    c.heartbeat("generating")
    assert "worker-silent" not in {s["id"] for s in c.status()["stalled"]}
    time.sleep(2.0)  # > stall_warn 1.5
    stalled = {s["id"]: s for s in c.status()["stalled"]}
    assert stalled["worker-silent"]["silent_s"] >= 1.5
    assert "worker-silent" not in {s["id"] for s in c.status(stall_warn=60)["stalled"]}  # per-call override
    c.heartbeat("generating")  # rejoins
    assert "worker-silent" not in {s["id"] for s in c.status()["stalled"]}
    c.heartbeat("done")  # a participant that finished is never stalled
    time.sleep(2.0)
    assert "worker-silent" not in {s["id"] for s in c.status()["stalled"]}


def test_status_token_rule(server):
    url = server.url
    for path in ("/status", "/"):
        assert requests.get(url + path, timeout=10).status_code == 401
        assert requests.get(url + path, params={"token": "wrong"}, timeout=10).status_code == 401
        assert requests.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
        assert requests.get(url + path, params={"token": TOKEN}, timeout=10).status_code == 200  # a browser
    # the query token is for the status views only
    assert requests.get(url + "/get", params={"token": TOKEN}, timeout=10).status_code == 401
    assert requests.post(url + "/heartbeat", params={"token": TOKEN}, json={}, timeout=10).status_code == 401


def test_heartbeat_input_checks(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.post(server.url + "/heartbeat", json={}, headers=auth, timeout=10)
    assert r.status_code == 400 and "X-GRPO-Id" in r.json()["error"]
    r = requests.post(server.url + "/heartbeat", data=b"[1", headers={**auth, "X-GRPO-Id": "x"}, timeout=10)
    assert r.status_code == 400
    r = requests.get(server.url + "/status", params={"stall_warn": "nan"}, headers=auth, timeout=10)
    assert r.status_code == 400
    # hostile identity values are cleaned, never echoed raw into the HTML page
    requests.post(server.url + "/heartbeat", json={"state": "<script>x</script>", "rounds": "many"},
                  headers={**auth, "X-GRPO-Id": "<b>evil</b>", "X-GRPO-Version": "abc"}, timeout=10).raise_for_status()
    page = requests.get(server.url + "/", params={"token": TOKEN}, timeout=10).text
    assert "<script>x" not in page and "<b>evil" not in page and "&lt;b&gt;evil" in page


def test_html_page_refreshes_itself_and_shows_the_table(server):
    client(server, "worker-html", "worker").heartbeat("generating")
    page = requests.get(server.url + "/", params={"token": TOKEN}, timeout=10)
    assert page.headers["Content-Type"].startswith("text/html")
    assert '<meta http-equiv="refresh"' in page.text and "<script" not in page.text
    assert "worker-html" in page.text and "last upload" in page.text


def test_launch_status_prints_the_table(server):
    client(server, "worker-cli", "worker").heartbeat("generating")
    cmd = ["bash", str(REPO / "launch.sh"), "status", "--ref-url", server.url, "--token-file", str(server.token_file),
           "--stall-warn", "600"]
    out = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "worker-cli" in out.stdout and "stalled: none" in out.stdout
    time.sleep(1.6)
    cmd[-1] = "1.5"
    out = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and "! worker-cli" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ref_server.status_cli", "--ref-url", server.url], cwd=REPO,
                         env=subprocess_env(GRPO_REF_TOKEN="wrong"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "401" in bad.stderr


def test_status_of_a_dead_server_is_a_clear_error(free_port):
    with pytest.raises(RefServerError) as e:
        RefClient(f"http://127.0.0.1:{free_port}").status(timeout=2)
    assert e.value.status == 0 and str(free_port) in str(e.value)


def test_table_is_bounded_and_formats_empty():
    from ref_server import status as st
    t = HeartbeatTable()
    for i in range(st.MAX_PARTICIPANTS + 10):
        t.on_heartbeat({"id": f"p{i}", "role": "worker", "host": "h", "version": None}, {})
    rows, _ = t.snapshot(stall_warn=100)
    assert len(rows) == st.MAX_PARTICIPANTS
    text = format_table({"participants": [], "stalled": [], "queues": {}, "weights": {}})
    assert "no participant" in text and "stalled: none" in text


def test_tool_counters_from_heartbeats_show_in_the_table():
    t = HeartbeatTable()
    t.on_heartbeat({"id": "worker0", "role": "worker", "host": "h", "version": 3},
                   {"state": "generating", "completions": 40, "tool_calls": 30, "tool_failed": 2,
                    "tool_timed_out": 1, "tool_malformed": 4})
    t.on_heartbeat({"id": "trainer-rank0", "role": "rank", "host": "h", "version": 3}, {"state": "training"})
    rows, _ = t.snapshot(stall_warn=100)
    w = next(r for r in rows if r["id"] == "worker0")
    assert (w["completions"], w["tool_calls"], w["tool_failed"], w["tool_timed_out"], w["tool_malformed"]) == \
        (40, 30, 2, 1, 4)
    text = format_table({"participants": rows, "stalled": [], "queues": {}, "weights": {}})
    assert "tool calls" in text and "30 (0.75; 2/1/4)" in text
    plain = format_table({"participants": [r for r in rows if r["id"] != "worker0"], "stalled": [], "queues": {},
                          "weights": {}})
    assert "tool calls" not in plain  # a run without tools: the table as before


def test_a_producer_with_no_reward_spread_shows_as_not_training():
    """Issue 60: a run whose groups never spread read `stalled: none` with 0 in the ranks' "no spread" column: the
    producers are alive, so not stalled, yet nothing trains; their heartbeat state (trainer/run/stall.py state())
    and live skipped count say so, and a line names them."""
    from trainer.rollout import RolloutStats
    from trainer.run.stall import StallReporter
    rep = StallReporter("trainer-rank0")
    rep.add(RolloutStats(groups=3, skipped_no_spread=3, rewards=[0.0] * 24), produced=0)
    t = HeartbeatTable()
    t.on_heartbeat({"id": "trainer-rank0", "role": "rank", "host": "h", "version": 0},
                   {"state": f"{rep.state()}; generating its own rollouts", "skipped_groups": rep.skipped})
    rows, _ = t.snapshot(stall_warn=100)
    text = format_table({"participants": rows, "stalled": [], "queues": {}, "weights": {}})
    assert "nothing to train: 3 groups in a row without reward spread" in text and "stalled: none" in text
    assert "not training: trainer-rank0" in text and "train_zero_spread" in text
    assert rows[0]["skipped_groups"] == 3


def test_a_worker_takes_the_ranks_step_count_under_num_train_epochs(server):
    """Issue 60: with num_train_epochs, all_steps needs the ranks' world size, so genonly workers reported the
    unresolved default (1000) as trainer_state.max_steps; a rank's heartbeat now carries it and the worker waits for
    it (a real ref server). Without num_train_epochs the worker asks nothing."""
    from common.config import GRPOConfig
    from trainer.worker import epochs_run_length
    cfg = GRPOConfig(num_train_epochs=2.0, wait_for_ranks_timeout=30)
    client(server, "trainer-rank0", "rank").heartbeat("training step 1", all_steps=37)
    doing = {"now": ""}
    epochs_run_length(client(server, "worker0", "worker"), cfg, doing)
    assert cfg.all_steps == 37 and "num_train_epochs" in doing["now"]
    plain = GRPOConfig(all_steps=5)
    epochs_run_length(None, plain, doing)  # no client call at all
    assert plain.all_steps == 5


def test_agent_faults_from_heartbeats_are_kept():
    t = HeartbeatTable()
    t.on_heartbeat({"id": "worker0", "role": "worker", "host": "h", "version": 1},
                   {"state": "generating", "rounds": 3, "agent_faults": 5})
    rows, _ = t.snapshot(stall_warn=100)
    assert rows[0]["agent_faults"] == 5  # GET /status: rollouts whose agent failed (trainer/worker.py)
