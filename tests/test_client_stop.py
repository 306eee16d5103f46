"""A process that is stopping does not retry against a ref server that is gone (launch.sh stops the server with
the run): the worker's last round ends in seconds and it logs its totals ("worker done: ... generated N tokens"),
which bench/gpu_check.py reads; before, a request in backoff outlived launch.sh's 15 s and the worker was killed."""
from __future__ import annotations

import time

import pytest
from conftest import find_free_port

from common.weights.sync import WeightSync
from common.wire.client import RefClient, RefServerError


def test_a_stopping_client_does_not_retry():
    url = f"http://127.0.0.1:{find_free_port()}"  # nothing listens: every request fails to connect
    client = RefClient(url, timeout=5, max_retries=20, backoff=0.5)
    asked = {"stop": False}
    client.give_up = lambda: asked["stop"]
    t0 = time.time()
    with pytest.raises(RefServerError, match="gave up after 2 retries"):
        RefClient(url, timeout=5, max_retries=2, backoff=0.05).health(retry=True)  # not stopping: it retries
    asked["stop"] = True
    t1 = time.time()
    with pytest.raises(RefServerError, match="unreachable"):
        client.health(retry=True)
    assert time.time() - t1 < 2.0, "a stopping client waited in backoff"  # 20 retries: over a minute
    sync = WeightSync(client=client)
    t2 = time.time()
    assert sync._fetch_retrying(retries=5, backoff=0.5) is None  # 15 s of backoff when not stopping
    assert time.time() - t2 < 2.0 and t1 - t0 >= 0.1
