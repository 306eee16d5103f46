"""Truncated importance sampling and the mismatch metric, against a float64 re-derivation."""
from __future__ import annotations

import math

import numpy as np
import torch

from trainer.grpo import grpo_loss, mismatch_stats, tis_weights


def reference_tis_loss(logps, old, engine, adv, mask, cap, beta, ref, eps) -> float:
    """seq_mean GRPO with ratio against the trainer's old logp and per-token weight min(exp(old - engine), cap)."""
    B, T = logps.shape
    per_seq = []
    for i in range(B):
        s = n = 0
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp(logps[i, t] - old[i, t])
            w = min(math.exp(old[i, t] - engine[i, t]), cap)
            term = -w * min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            d = ref[i, t] - logps[i, t]
            term += beta * (math.exp(d) - d - 1)
            s, n = s + term, n + 1
        per_seq.append(s / max(n, 1))
    return float(np.mean(per_seq))


def make(seed=0, B=4, T=7):
    g = np.random.default_rng(seed)
    logps = -g.uniform(0.1, 3, (B, T))
    old = logps + g.normal(0, 0.05, (B, T))
    engine = old + g.normal(0, 0.4, (B, T))  # a sloppy bf16 engine
    ref = logps + g.normal(0, 0.1, (B, T))
    adv = g.normal(0, 1, B)
    mask = np.ones((B, T), bool)
    mask[0, 5:] = False
    mask[2, 2:] = False
    return logps, old, engine, ref, adv, mask


def test_tis_loss_matches_float64_reference():
    logps, old, engine, ref, adv, mask = make()
    for cap in (1.0, 2.0, 1e9):
        t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
        w = tis_weights(t(old), t(engine), cap)
        got = grpo_loss(t(logps), t(ref), t(old), t(adv), torch.tensor(mask), beta=0.04, eps_low=0.2, eps_high=0.2,
                        aggregation="seq_mean", max_new_tokens=7, is_weights=w)
        want = reference_tis_loss(logps, old, engine, adv, mask, cap, 0.04, ref, 0.2)
        assert abs(float(got) - want) < 1e-10, (cap, float(got), want)


def test_tis_weights_are_capped_and_carry_no_gradient():
    old = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    engine = torch.tensor([[-5.0, -1.0, 0.0]])
    w = tis_weights(old, engine, 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, math.exp(-2.0)]]))
    assert not w.requires_grad


def test_no_weights_is_the_plain_loss():
    logps, old, engine, ref, adv, mask = make(1)
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    kw = dict(beta=0.04, eps_low=0.2, eps_high=0.2, aggregation="token_mean", max_new_tokens=7)
    a = grpo_loss(t(logps), t(ref), t(engine), t(adv), torch.tensor(mask), **kw)
    b = grpo_loss(t(logps), t(ref), t(engine), t(adv), torch.tensor(mask), is_weights=torch.ones(4, 7), **kw)
    assert float(a) == float(b)


def test_mismatch_stats_over_trained_tokens_only():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -3.0], [-1.0, -0.75, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the 9.0 gap is padding
    s = mismatch_stats(logps, engine, mask)
    assert abs(s["logp_mismatch_mean"] - (0.5 + 0.25) / 5) < 1e-7
    assert s["logp_mismatch_max"] == 0.5
