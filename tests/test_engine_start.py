"""trainer/deepspeed_policy.py's start of a rank: DeepSpeed's Muon kernels are left uncompiled unless ds_config asks for
Muon (their torch.compile at import cost every rank ~1 CPU-s of inductor import), and nothing after is affected."""
from __future__ import annotations

import os

import torch

from trainer.deepspeed_policy import muon_left_uncompiled


def kernel(x):
    return x


def test_muon_is_left_uncompiled_unless_asked_and_the_variable_is_restored(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with muon_left_uncompiled({"optimizer": {"type": "AdamW", "params": {}}}):
        assert torch.compile(kernel) is kernel  # decorated inside: a no-op, as DeepSpeed's Muon kernels then are
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    assert torch.compile(kernel) is not kernel  # after: torch.compile as before
    with muon_left_uncompiled({"optimizer": {"type": "Muon", "params": {}}}):
        assert torch.compile(kernel) is not kernel  # a Muon run: its kernels compiled as DeepSpeed means them
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # the user's own setting comes back after
    with muon_left_uncompiled({"optimizer": {"type": "AdamW"}}):
        assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
