"""Checkpoint hygiene (issue 11, items 9-10): retention, the model's own dtype, TensorBoard after --resume."""
from __future__ import annotations

import json

import torch

from trainer.checkpoint import cast_state, prune_checkpoints, source_dtype
from trainer.run.metrics import MetricsLogger


def _make(out, names):
    for n in names:
        (out / n).mkdir(parents=True)
        (out / n / "x").write_text("1")


def test_prune_keeps_newest_of_each_kind(tmp_path):
    _make(tmp_path, ["step_2", "step_4", "step_10", "final", "ds/step2", "ds/step4", "ds/step10"])
    (tmp_path / "ds" / "latest").write_text("step10")
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["step2", "step_2"]  # numeric order: step_10 is the newest
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ds", "final", "step_10", "step_4"]
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["latest", "step10", "step4"]


def test_prune_never_removes_latest_tag_and_zero_keeps_all(tmp_path):
    _make(tmp_path, ["ds/step2", "ds/step4", "ds/step6"])
    (tmp_path / "ds" / "latest").write_text("step2")  # odd, but the tag a resume loads must survive
    prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["latest", "step2", "step6"]
    assert prune_checkpoints(tmp_path, 0) == []


def test_cast_state_keeps_tied_tensors_shared():
    emb = torch.randn(4, 3)
    state = {"embed.weight": emb, "lm_head.weight": emb, "steps": torch.tensor([1])}
    out = cast_state(state, torch.bfloat16)
    assert out["embed.weight"].dtype == torch.bfloat16 and out["embed.weight"] is out["lm_head.weight"]
    assert out["steps"].dtype == torch.long
    assert cast_state(state, None) is state


def test_source_dtype_reads_config(tmp_path, tiny_model_dir):
    assert source_dtype(str(tiny_model_dir)) == torch.float32
    conf = json.loads((tiny_model_dir / "config.json").read_text())
    conf["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(conf))
    assert source_dtype(str(tmp_path)) == torch.bfloat16


def _tb_steps(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_tensorboard_has_no_duplicate_step_after_resume(tmp_path):
    first = MetricsLogger(tmp_path)
    for step in range(1, 6):  # crashed after step 5; the last checkpoint was step 4
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, resume_step=4)
    for step in (5, 6):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    assert _tb_steps(tmp_path / "tensorboard", "loss") == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-2]["loss"] == 15.0


def test_config_knobs_of_issue_11():
    from common.config import GRPOConfig
    from common.settings.knobs import load_config

    cfg = load_config(GRPOConfig, ["--save_total_limit", "3", "--worker_dtype", "bfloat16",
                                   "--train_zero_spread", "true"])
    assert (cfg.save_total_limit, cfg.worker_dtype, cfg.train_zero_spread) == (3, "bfloat16", True)
    assert GRPOConfig().save_total_limit == 2 and GRPOConfig().train_zero_spread is False
    for bad in (["--save_total_limit", "-1"], ["--worker_dtype", "int8"], ["--log_stall_every", "0"]):
        try:
            load_config(GRPOConfig, bad)
        except ValueError as e:
            assert bad[0].lstrip("-") in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
