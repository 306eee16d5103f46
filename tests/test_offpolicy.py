"""Off-policy correction (trainer/objective/offpolicy.py) against a float64 re-derivation: TRL's four
importance-sampling modes, the off-policy sequence mask, and the loss with π_old = the trainer's first pass and IS
weights."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import GRPOConfig
from trainer.objective.grpo import grpo_loss, mismatch_stats
from trainer.objective.offpolicy import importance_weights, in_band_share, off_policy_mask


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


def reference_weights(old, engine, mask, mode, lo, hi):
    """Loops in float64: rho per token or exp(sum over the completion), truncated or masked to [lo, hi]."""
    B, T = old.shape
    w = np.zeros((B, T))
    out = n = 0
    for i in range(B):
        if mode.startswith("sequence"):
            rho = math.exp(sum(old[i, t] - engine[i, t] for t in range(T) if mask[i, t]))
            rhos = [rho] * T
        else:
            rhos = [math.exp(old[i, t] - engine[i, t]) for t in range(T)]
        for t in range(T):
            r = rhos[t]
            bad = (lo is not None and r < lo) or (hi is not None and r > hi)
            if mode.endswith("truncate"):
                r = min(max(r, lo if lo is not None else -1), hi if hi is not None else math.inf)
            elif bad:
                r = 0.0
            w[i, t] = r
            if mask[i, t] and not mode.startswith("sequence"):
                out, n = out + bad, n + 1
        if mode.startswith("sequence"):
            out, n = out + ((lo is not None and rhos[0] < lo) or (hi is not None and rhos[0] > hi)), n + 1
    return w, out / n


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("lo,hi", [(None, 3.0), (0.5, 1.5), (None, None)])
def test_importance_weights_match_float64(mode, lo, hi):
    logps, old, engine, ref, adv, mask = make()
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w, st = importance_weights(t(old), t(engine), torch.tensor(mask), mode, hi, lo)
    want, share = reference_weights(old, engine, mask, mode, lo, hi)
    np.testing.assert_allclose(w.numpy()[mask], want[mask], rtol=1e-12)
    assert abs(st["is_masked_share"] - share) < 1e-12
    assert abs(st["is_weight_mean"] - want[mask].mean()) < 1e-12
    assert not w.requires_grad


def reference_loss(logps, old, w, adv, mask, beta, ref, eps):
    """seq_mean GRPO, ratio against π_old, per-token weight w on the policy term."""
    per_seq = []
    for i in range(logps.shape[0]):
        s = n = 0
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(logps[i, t] - old[i, t])
            term = -w[i, t] * min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            d = ref[i, t] - logps[i, t]
            s, n = s + term + beta * (math.exp(d) - d - 1), n + 1
        per_seq.append(s / max(n, 1))
    return float(np.mean(per_seq))


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_loss_with_is_weights_matches_float64(mode):
    logps, old, engine, ref, adv, mask = make(3)
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w, _ = importance_weights(t(old), t(engine), torch.tensor(mask), mode, 2.0, None)
    x = t(logps).requires_grad_(True)
    got = grpo_loss(x, t(ref), t(old), t(adv), torch.tensor(mask), beta=0.04, eps_low=0.2, eps_high=0.2,
                    aggregation="seq_mean", max_new_tokens=7, is_weights=w)
    want_w, _ = reference_weights(old, engine, mask, mode, None, 2.0)
    assert abs(got.item() - reference_loss(logps, old, want_w, adv, mask, 0.04, ref, 0.2)) < 1e-10
    got.backward()
    h = 1e-6  # central differences of the float64 reference, a few coordinates
    for (i, j) in [(0, 0), (1, 3), (3, 6), (2, 1)]:
        up, dn = logps.copy(), logps.copy()
        up[i, j] += h
        dn[i, j] -= h
        fd = (reference_loss(up, old, want_w, adv, mask, 0.04, ref, 0.2)
              - reference_loss(dn, old, want_w, adv, mask, 0.04, ref, 0.2)) / (2 * h)
        assert abs(float(x.grad[i, j]) - fd) < 1e-7, (i, j, float(x.grad[i, j]), fd)


def test_off_policy_mask_drops_negative_advantage_high_kl_sequences():
    logps = torch.zeros(4, 3)
    sampling = torch.tensor([[0.5] * 3, [0.5] * 3, [0.01] * 3, [0.5, 0.5, 9.0]])
    mask = torch.tensor([[True] * 3] * 3 + [[True, True, False]])  # row 3's 9.0 is padding
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    keep, dropped = off_policy_mask(adv, logps, sampling, mask, threshold=0.1)
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 1.0, 0.0]  # high KL and A < 0: rows 0 and 3
    assert dropped == 0.5


def test_gspo_in_band_share():
    mask = torch.ones(3, 2, dtype=torch.bool)
    old = torch.zeros(3, 2)
    logps = torch.tensor([[1e-4, 1e-4], [5e-4, 5e-4], [-1e-3, 0.0]])  # s = e^1e-4 in, e^5e-4 out, e^-5e-4 out
    assert abs(in_band_share(logps, old, mask, 3e-4, 4e-4) - 1 / 3) < 1e-6
    assert in_band_share(old, old, mask, 3e-4, 4e-4) == 1.0  # π_old = the first pass: every sequence inside


def test_mismatch_stats_over_trained_tokens_only():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -3.0], [-1.0, -0.75, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the 9.0 gap is padding
    s = mismatch_stats(logps, engine, mask)
    assert abs(s["logp_mismatch_mean"] - (0.5 + 0.25) / 5) < 1e-7
    assert s["logp_mismatch_max"] == 0.5


def test_config_defaults_and_deprecated_tis_cap():
    c = GRPOConfig().validate()
    assert (c.old_logps, c.vllm_importance_sampling_correction, c.vllm_importance_sampling_mode,
            c.vllm_importance_sampling_clip_max, c.vllm_importance_sampling_clip_min) == \
        ("trainer", True, "sequence_mask", 3.0, None)  # TRL 1.16's defaults
    c = GRPOConfig(tis_cap=2.0).validate()
    assert (c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_max, c.tis_cap) == \
        ("token_truncate", 2.0, None)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        GRPOConfig(vllm_importance_sampling_mode="token").validate()
    with pytest.raises(ValueError, match="compute_gen_logps"):
        GRPOConfig(old_logps="engine", compute_gen_logps=False).validate()
    with pytest.raises(ValueError, match="clip_min"):
        GRPOConfig(vllm_importance_sampling_clip_min=4.0).validate()
