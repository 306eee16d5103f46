"""The ref server's limit on a policy-weights publish (issue 30): by default derived from the model it holds
(parameters x 4 bytes x 1.25 + 64 MiB), --max_weights_mb overrides it, and a publish over it ends the trainer
with one line naming the limit and the knob. A real ref server process; the trainer side is the real Publisher
(and, marked slow, a real one-rank trainer run)."""
from __future__ import annotations

import socket
import subprocess

import pytest
import requests
from conftest import REPO, find_free_port, start_ref_server
from test_e2e import TOY, env

from common.config import GRPOConfig
from common.modeling import load_model
from common.settings.knobs import load_config
from common.weights.blob import ParametersBody
from common.wire.client import RefClient
from trainer.publish import Publisher
from trainer.run.health import EXIT_WEIGHTS_REFUSED, WeightsRefused

MIB = 1 << 20


def unique_parameter_count(model) -> int:
    """Elements of the model's distinct tensors (a tied weight once), counted from the state dict."""
    seen: dict[int, int] = {}
    for t in model.state_dict().values():
        if t.is_floating_point():
            seen[t.untyped_storage().data_ptr()] = t.numel()
    return sum(seen.values())


def declare(port: int, length: int) -> bytes:
    """A header-only PUT /weights declaring `length` bytes; the server's whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"PUT /weights?version=1 HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        s.settimeout(2)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except TimeoutError:  # the server waits for the body: it took the declaration
            pass
    return data


def test_default_limit_is_derived_from_the_model(tiny_model_dir):
    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    n = unique_parameter_count(model)
    expected = int(n * 4 * 1.25) + 64 * MIB
    fp32_publish = len(ParametersBody(model))  # what a trainer in float32 sends: must fit
    assert n * 4 < fp32_publish < expected
    with start_ref_server(tiny_model_dir, "--device", "cpu") as srv:
        # one byte over: the JSON 413 at once, naming the limit and the knob; at the limit: the body is awaited
        over = declare(srv.port, expected + 1)
        assert over.startswith(b"HTTP/1.1 413"), over[:300]
        assert f"exceed this server's max_weights_mb {expected / MIB:,.0f} (default".encode() in over
        assert b"start the ref server with --max_weights_mb" in over
        assert declare(srv.port, expected) == b""
        # the limit in force, shown at startup and by GET /status
        assert f"up to {expected / MIB:,.0f} MiB (default, derived from its model" in srv.log()
        w = requests.get(srv.url + "/status", timeout=10).json()["weights"]
        assert w["max_weights_mb"] == round(expected / MIB, 1), (w, expected)
        assert w["max_weights_how"].startswith("default, derived from its model")


def test_explicit_max_weights_mb_overrides_and_a_publish_over_it_ends_with_one_line(tiny_model_dir):
    """--max-weights-mb 1; the tiny model in float32 (4.3 MiB) is also past waitress' own body cap (2 MiB here),
    which used to answer first with its plain-text 413 naming neither the limit nor the knob."""
    cfg = load_config(GRPOConfig, ["--num_gen_workers", "1", "--sync_steps", "1", "--sync_delta", "false"])
    policy = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    size = len(ParametersBody(policy))
    with start_ref_server(tiny_model_dir, "--device", "cpu", "--max-weights-mb", "1", "--max-body-mb", "1") as srv:
        client = RefClient(srv.url, max_retries=2, backoff=0.1)
        publisher = Publisher(cfg, client, policy, None, rank=0, zero_stage=0)
        with pytest.raises(WeightsRefused) as e:
            publisher.publish(3)
        line = str(e.value)
        print(f"\n{line}")
        assert line == (f"rank 0: ref server {srv.url} refused the weights of step 3: policy weights of "
                        f"{size / MIB:,.0f} MiB exceed this server's max_weights_mb 1 (set by --max_weights_mb); "
                        f"start the ref server with --max_weights_mb {-(-size // MIB)} or more")
        assert declare(srv.port, MIB + 1).startswith(b"HTTP/1.1 413")
        w = requests.get(srv.url + "/status", timeout=10).json()["weights"]
        assert (w["max_weights_mb"], w["max_weights_how"]) == (1.0, "set by --max_weights_mb")


@pytest.mark.slow
def test_trainer_run_ends_with_the_line_and_exit_6(tiny_model_dir, tmp_path):
    """A real one-rank trainer whose first publish (before step 1) is refused: exit 6, the line in its log and
    in diagnosis.txt (launch.sh repeats it), no traceback."""
    run_dir = tmp_path / "run"
    with start_ref_server(tiny_model_dir, "--device", "cpu", "--max-weights-mb", "1") as srv:
        cmd = [str(REPO / ".venv" / "bin" / "deepspeed"), "--num_gpus", "1", "--master_port", str(find_free_port()),
               "trainer/main.py", *TOY, "--Q_batch_size", "2", "--ref_server", srv.url, "--output_dir", str(run_dir),
               "--num_gen_workers", "1", "--all_steps", "2"]
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    diagnosis = (run_dir / "diagnosis.txt").read_text().splitlines()
    print(f"\nexit {proc.returncode}: {diagnosis}")
    assert proc.returncode == EXIT_WEIGHTS_REFUSED, out[-3000:]
    assert len(diagnosis) == 1 and "exceed this server's max_weights_mb 1 (set by --max_weights_mb)" in diagnosis[0]
    assert "start the ref server with --max_weights_mb 5 or more" in diagnosis[0]
    assert diagnosis[0] in out and "Traceback" not in out, out[-3000:]
