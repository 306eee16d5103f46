"""TRL 1.16's loss family (issue 24): loss_type bnpo, cispo, sapo, luspo and top_entropy_quantile, each against a
float64 re-derivation of the loss and of its gradient (loops over tokens, no torch), as tests/test_grpo.py does."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import GRPOConfig
from common.settings.knobs import load_config
from trainer.objective.grpo import entropy_mask, grpo_loss


def data(seed=0, B=4, T=6):
    g = np.random.default_rng(seed)
    logps = -g.uniform(0.1, 3, (B, T))
    old = logps + g.normal(0, 0.3, (B, T))  # far enough for clips and gates to act
    ref = logps + g.normal(0, 0.1, (B, T))
    adv = np.array([1.3, -0.7, 0.4, -1.1])
    mask = np.ones((B, T), bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return logps, old, ref, adv, mask


def ref_term(objective, lp, old_lp, a, eps_low, eps_high, tau):
    """The policy term of one token in float64 (the sequence ratio is handled by the caller)."""
    r = math.exp(lp - old_lp)
    if objective == "cispo":
        return -min(r, eps_high) * a * lp
    if objective == "sapo":
        t = tau[0] if a > 0 else tau[1]
        return -(1 / (1 + math.exp(-t * (r - 1)))) * 4 / t * a
    return -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)


def ref_loss(logps, old, ref, adv, mask, *, objective, aggregation, level, beta, eps_low, eps_high,
             tau=(1.0, 1.05), weights=None, bias_kl=False):
    B, T = logps.shape
    rows = []
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        if level == "sequence":  # GSPO: one ratio exp(mean(logp - old)) for the whole completion
            s = sum(logps[i, t] - old[i, t] for t in idx) / len(idx)
        terms = []
        for t in idx:
            lp, o = (logps[i, t], old[i, t]) if level == "token" else (s + old[i, t], old[i, t])
            term = ref_term(objective, lp, o, adv[i], eps_low, eps_high, tau)
            if objective == "cispo" and level == "sequence":
                term = -min(math.exp(s), eps_high) * adv[i] * logps[i, t]
            term *= 1.0 if weights is None else weights[i, t]
            d = ref[i, t] - logps[i, t]
            r = math.exp(logps[i, t] - old[i, t]) if level == "token" else math.exp(s)  # TRL's coef_1
            terms.append(term + beta * (math.exp(d) - d - 1) * (r if bias_kl else 1.0))
        rows.append(terms)
    if aggregation == "seq_mean":
        return float(np.mean([sum(r) / len(r) for r in rows]))
    if aggregation == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if aggregation == "luspo":
        return float(np.mean([sum(r) for r in rows]))
    raise ValueError(aggregation)


def cispo_grad(logps, old, adv, mask, eps_high, aggregation, weights=None):
    """d loss / d logp for CISPO (the weight min(r, eps_high) is a constant): -w_it * A_i / normaliser."""
    g = np.zeros_like(logps)
    n_tok = mask.sum()
    for i in range(logps.shape[0]):
        n_i = mask[i].sum()
        for t in range(logps.shape[1]):
            if mask[i, t]:
                c = -min(math.exp(logps[i, t] - old[i, t]), eps_high) * adv[i]
                c *= 1.0 if weights is None else weights[i, t]
                g[i, t] = c / (n_i * logps.shape[0]) if aggregation == "seq_mean" else c / n_tok
    return g


CASES = [  # (objective, aggregation, level, eps_low, eps_high): what each TRL loss_type runs
    ("clip", "token_mean", "token", 0.2, 0.28),     # bnpo
    ("cispo", "token_mean", "token", 0.2, 1.1),     # cispo (dapo aggregation = token_mean on one rank)
    ("sapo", "seq_mean", "token", 0.2, 0.2),        # sapo
    ("sapo", "seq_mean", "sequence", 3e-4, 4e-4),   # sapo with a sequence ratio
    ("clip", "luspo", "sequence", 3e-3, 4e-3),      # luspo
]


@pytest.mark.parametrize("objective, aggregation, level, eps_low, eps_high", CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_float64(objective, aggregation, level, eps_low, eps_high, beta):
    logps, old, ref, adv, mask = data()
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w = np.random.default_rng(5).uniform(0.5, 1.5, logps.shape)  # IS-style weights on the policy term
    kw = dict(objective=objective, aggregation=aggregation, level=level, beta=beta, eps_low=eps_low,
              eps_high=eps_high, weights=w)
    x = t(logps).requires_grad_(True)
    got = grpo_loss(x, t(ref), t(old), t(adv), torch.tensor(mask), beta=beta, eps_low=eps_low, eps_high=eps_high,
                    aggregation=aggregation, max_new_tokens=6, importance_sampling_level=level, is_weights=t(w),
                    objective=objective, sapo_tau=(1.0, 1.05))
    want = ref_loss(logps, old, ref, adv, mask, **kw)
    assert abs(got.item() - want) < 1e-10, (got.item(), want)
    got.backward()
    if objective == "cispo":
        g = cispo_grad(logps, old, adv, mask, eps_high, aggregation, w)
        if beta:  # plus the KL term's own gradient: d/dlogp beta*(e^d - d - 1), d = ref - logp
            d = ref - logps
            kl = beta * (1 - np.exp(d)) * mask
            g = g + (kl / mask.sum(1, keepdims=True) / 4 if aggregation == "seq_mean" else kl / mask.sum())
        np.testing.assert_allclose(x.grad.numpy(), g, atol=1e-10)
        return
    h = 1e-6
    for (i, j) in [(0, 0), (0, 5), (1, 2), (2, 3), (3, 1)]:
        up, dn = logps.copy(), logps.copy()
        up[i, j] += h
        dn[i, j] -= h
        fd = (ref_loss(up, old, ref, adv, mask, **kw) - ref_loss(dn, old, ref, adv, mask, **kw)) / (2 * h)
        assert abs(float(x.grad[i, j]) - fd) < 1e-7, (i, j, float(x.grad[i, j]), fd)
    assert float(x.grad[3, 4]) == 0.0  # padding


@pytest.mark.parametrize("objective, aggregation, level, eps_low, eps_high",
                         [c for c in CASES if c[0] != "cispo"] + [("clip", "seq_mean", "token", 0.2, 0.2)])
def test_bias_corrected_kl_matches_float64(objective, aggregation, level, eps_low, eps_high):
    """Issue 40: TRL's use_bias_correction_kl: per_token_kl * coef_1 (the token or sequence ratio, not detached),
    the IS-style weights on the policy term only. Loss and gradient against the float64 loops."""
    logps, old, ref, adv, mask = data(3)
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w = np.random.default_rng(6).uniform(0.5, 1.5, logps.shape)
    kw = dict(objective=objective, aggregation=aggregation, level=level, beta=0.3, eps_low=eps_low,
              eps_high=eps_high, weights=w, bias_kl=True)
    x = t(logps).requires_grad_(True)
    got = grpo_loss(x, t(ref), t(old), t(adv), torch.tensor(mask), beta=0.3, eps_low=eps_low, eps_high=eps_high,
                    aggregation=aggregation, max_new_tokens=6, importance_sampling_level=level, is_weights=t(w),
                    objective=objective, bias_correction_kl=True)
    want = ref_loss(logps, old, ref, adv, mask, **kw)
    assert abs(got.item() - want) < 1e-10, (got.item(), want)
    assert abs(want - ref_loss(logps, old, ref, adv, mask, **{**kw, "bias_kl": False})) > 1e-5  # it changes the loss
    got.backward()
    h = 1e-6
    for (i, j) in [(0, 0), (0, 5), (1, 2), (2, 3), (3, 1)]:
        up, dn = logps.copy(), logps.copy()
        up[i, j] += h
        dn[i, j] -= h
        fd = (ref_loss(up, old, ref, adv, mask, **kw) - ref_loss(dn, old, ref, adv, mask, **kw)) / (2 * h)
        assert abs(float(x.grad[i, j]) - fd) < 1e-7, (i, j, float(x.grad[i, j]), fd)


def test_bias_corrected_kl_on_policy_changes_the_gradient_not_the_value():
    """At ratio 1 (π_old = this pass's logps) the value is the plain KL's, the gradient gains k3 * grad(logp)."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    out = {}
    for on in (False, True):
        lp.grad = None
        loss = grpo_loss(lp, ref, lp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=bool),
                         beta=1.0, eps_low=0.2, eps_high=0.2, aggregation="token_mean", max_new_tokens=2,
                         bias_correction_kl=on)
        loss.backward()
        out[on] = (loss.item(), lp.grad.clone())
    assert out[True][0] == pytest.approx(out[False][0])
    d = (ref - lp.detach())
    assert torch.allclose(out[True][1] - out[False][1], (torch.exp(d) - d - 1) / 2)


def test_sapo_gate_is_the_policy_gradient_at_ratio_one():
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    for a in (1.0, -1.0):
        logps.grad = None
        grpo_loss(logps, None, logps.detach(), torch.tensor([a], dtype=torch.float64), torch.ones(1, 2, dtype=bool),
                  beta=0, eps_low=0.2, eps_high=0.2, aggregation="token_mean", max_new_tokens=2,
                  objective="sapo").backward()
        assert torch.allclose(logps.grad, torch.full((1, 2), -a / 2, dtype=torch.float64))


def test_entropy_mask_keeps_the_top_quantile_of_completion_tokens():
    ent = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])  # 9.0 is padding
    m = entropy_mask(ent, mask, 0.5)
    vals = np.array([0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.8])
    cut = np.quantile(vals, 0.5)  # torch.quantile's default interpolation is numpy's linear
    want = (ent.numpy() >= cut) & mask.numpy()
    assert (m.numpy().astype(bool) == want).all() and m.sum() == 4
    assert torch.equal(entropy_mask(ent, mask, 1.0), mask.float())


def test_loss_type_sets_objective_and_aggregation():
    for lt, objective, agg in [("grpo", "clip", "seq_mean"), ("bnpo", "clip", "token_mean"), ("dapo", "clip", "dapo"),
                               ("dr_grpo", "clip", "dr_grpo"), ("sapo", "sapo", "seq_mean"),
                               ("luspo", "clip", "luspo")]:
        c = load_config(GRPOConfig, ["--loss_type", lt])
        assert (c.objective(), c.aggregation) == (objective, agg), lt
    c = load_config(GRPOConfig, ["--loss_type", "cispo", "--epsilon_high", "5.0"])  # TRL's names
    assert (c.objective(), c.aggregation, c.eps_high) == ("cispo", "dapo", 5.0)
    with pytest.raises(ValueError, match="epsilon_high"):
        load_config(GRPOConfig, ["--loss_type", "cispo"])  # eps_high 0.2 would cap every weight at 0.2
    with pytest.raises(ValueError, match="give one of them"):
        load_config(GRPOConfig, ["--loss_type", "bnpo", "--aggregation", "dr_grpo"])
    with pytest.raises(ValueError, match="unknown loss_type"):
        load_config(GRPOConfig, ["--loss_type", "gmpo"])


def test_entropy_quantile_zero_is_accepted_and_keeps_the_highest(tmp_path):
    """Issue 60: TRL accepts top_entropy_quantile 0.0 (its threshold quantile 1.0: the highest-entropy tokens)."""
    assert load_config(GRPOConfig, ["--top_entropy_quantile", "0"]).top_entropy_quantile == 0.0
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 0.2]])
    assert entropy_mask(ent, torch.ones(2, 3, dtype=torch.bool), 0.0).tolist() == [[0, 1, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        load_config(GRPOConfig, ["--top_entropy_quantile", "1.5"])


def _entropy_rank(rank: int, port: int, q) -> None:
    """One of two gloo ranks: its own tokens' entropies, cut with the other rank's (comm.all_gather_values)."""
    import torch.distributed as dist

    from trainer.dist import comm
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ent = [torch.tensor([[0.1, 0.2, 0.3, 0.4]]), torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])][rank]
    mask = torch.ones_like(ent, dtype=torch.bool)
    mask[-1, -1] = False  # ragged: rank 0 sends 3 values, rank 1 7
    q.put((rank, entropy_mask(ent, mask, 0.5, comm.all_gather_values).tolist()))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_entropy_cut_is_over_every_rank_as_trl():
    """Issue 60: TRL's get_high_entropy_mask gathers the entropies of every process before the cut. Two real gloo
    ranks: rank 0's low entropies all fall under the joint median (before: each rank cut its own, keeping half)."""
    import torch.multiprocessing as mp
    from conftest import find_free_port
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), find_free_port()
    procs = [ctx.Process(target=_entropy_rank, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    # the union of valid values: 0.1 0.2 0.3 1 2 3 4 5 6 7, median 2.5: rank 0 keeps nothing, rank 1 from 3
    assert got[0] == [[0.0, 0.0, 0.0, 0.0]]
    assert got[1] == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]


def test_cispo_at_sequence_level_caps_with_epsilon_high():
    """Issue 60: TRL's CISPO caps the weight with epsilon_high at either importance_sampling_level; the sequence
    level took GSPO's gspo_eps_high (4e-4), which capped every weight near 0."""
    from trainer.objective.update import _eps
    c = load_config(GRPOConfig, ["--loss_type", "cispo", "--eps_high", "5.0", "--importance_sampling_level",
                                 "sequence", "--gspo_eps_high", "4e-4"])
    assert _eps(c)["eps_high"] == 5.0
    c = load_config(GRPOConfig, ["--importance_sampling_level", "sequence"])  # GSPO's clip unchanged
    assert _eps(c) == {"eps_low": 3e-4, "eps_high": 4e-4}
