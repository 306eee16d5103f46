"""GSPO, REINFORCE++-baseline and DAPO overlong shaping against plain float64 re-derivations (numpy, loops).

Each oracle test prints its max abs difference (run with -s to see them)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_grpo import random_inputs

from trainer.objective.grpo import group_advantages, grpo_loss, loss_stats, overlong_penalty, reinforce_pp_advantages


def gspo_reference(logps, ref, gen, adv, mask, beta, eps_low, eps_high, aggregation, max_new_tokens) -> float:
    """GSPO written out: s_i = exp(mean over the completion's tokens of (logp - gen)), per-sequence clip,
    the sequence term on every token, plus the per-token k3 KL; then the usual aggregation."""
    logps, adv, mask = np.asarray(logps, np.float64), np.asarray(adv, np.float64), np.asarray(mask, bool)
    B, T = logps.shape
    per_seq, total, count = [], 0.0, 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if gen is None:
            pg = adv[i]  # REINFORCE form: s_i == 1 in value
        else:
            s_i = math.exp(sum(logps[i, t] - gen[i, t] for t in toks) / max(len(toks), 1))
            pg = min(s_i * adv[i], min(max(s_i, 1 - eps_low), 1 + eps_high) * adv[i])
        s = 0.0
        for t in toks:
            term = -pg
            if beta:
                d = ref[i, t] - logps[i, t]
                term += beta * (math.exp(d) - d - 1)
            s += term
        per_seq.append(s / max(len(toks), 1))
        total += s
        count += len(toks)
    if aggregation == "seq_mean":
        return float(np.mean(per_seq))
    if aggregation == "token_mean":
        return total / max(count, 1)
    return total / (B * max_new_tokens)


def gspo_inputs(seed: int, B: int = 6, T: int = 9):
    """Sequence log-ratios of a few 1e-4: some inside GSPO's tiny trust region [1-3e-4, 1+4e-4], some outside."""
    logps, ref, gen, adv, mask = random_inputs(seed, B, T)
    g = torch.Generator().manual_seed(100 + seed)
    gen = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5e-3
    return logps, ref, gen, adv, mask


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "dr_grpo"])
@pytest.mark.parametrize("use_gen", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_loss_matches_float64_reference(aggregation, use_gen, beta, eps):
    worst = 0.0
    for seed in range(4):
        logps, ref, gen, adv, mask = gspo_inputs(seed) if eps[0] < 0.01 else random_inputs(seed)
        got = grpo_loss(logps, ref if beta else None, gen if use_gen else None, adv, mask, beta=beta,
                        eps_low=eps[0], eps_high=eps[1], aggregation=aggregation, max_new_tokens=12,
                        importance_sampling_level="sequence")
        want = gspo_reference(logps.numpy(), ref.numpy(), gen.numpy() if use_gen else None, adv.numpy(),
                              mask.numpy(), beta, eps[0], eps[1], aggregation, 12)
        worst = max(worst, abs(float(got) - want))
        assert float(got) == pytest.approx(want, abs=1e-10, rel=1e-10)
    print(f"GSPO loss {aggregation} gen={use_gen} beta={beta} eps={eps}: max abs diff {worst:.2e}")


def test_gspo_clips_some_sequences_and_not_others():
    """The test inputs really exercise both branches of the sequence clip."""
    fracs = []
    for seed in range(4):
        logps, ref, gen, adv, mask = gspo_inputs(seed)
        fracs.append(loss_stats(logps, None, gen, adv, mask, eps_low=3e-4, eps_high=4e-4,
                                importance_sampling_level="sequence")["clip_frac"])
    assert 0 < sum(fracs) / 4 < 1, fracs


@pytest.mark.parametrize("use_gen", [True, False])
def test_gspo_gradient_matches_reference_by_finite_differences(use_gen):
    logps, ref, gen, adv, mask = gspo_inputs(3, B=4, T=5)
    x = logps.clone().requires_grad_(True)
    loss = grpo_loss(x, ref, gen if use_gen else None, adv, mask, beta=0.1, eps_low=3e-4, eps_high=4e-4,
                     aggregation="seq_mean", max_new_tokens=5, importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(loss, x)
    h, worst = 1e-7, 0.0
    args = (ref.numpy(), gen.numpy() if use_gen else None, adv.numpy(), mask.numpy(), 0.1, 3e-4, 4e-4, "seq_mean", 5)
    for i in range(4):
        for t in range(5):
            if not use_gen:  # REINFORCE form: the oracle's value does not move with logp; its gradient is known
                m = mask.numpy()
                n = m[i].sum()
                d = ref[i, t].item() - logps[i, t].item()
                fd = (-adv[i].item() / n + 0.1 * (1 - math.exp(d)) / n) / 4 if m[i, t] else 0.0
            else:
                plus, minus = logps.clone(), logps.clone()
                plus[i, t] += h
                minus[i, t] -= h
                fd = (gspo_reference(plus.numpy(), *args) - gspo_reference(minus.numpy(), *args)) / (2 * h)
            worst = max(worst, abs(float(grad[i, t]) - fd))
            assert float(grad[i, t]) == pytest.approx(fd, abs=1e-6)
    print(f"GSPO gradient gen={use_gen}: max abs diff {worst:.2e}")


def test_gspo_one_ratio_per_sequence():
    """Every unmasked token of a completion sees the same ratio: the length-normalised sequence ratio."""
    logps = torch.zeros(1, 3, dtype=torch.float64)
    gen = torch.tensor([[0.0, -0.3, 0.9]], dtype=torch.float64)  # token ratios 1, 1.35, 0.41
    mask = torch.tensor([[True, True, False]])
    st = loss_stats(logps, None, gen, torch.ones(1), mask, eps_low=0.2, eps_high=0.2,
                    importance_sampling_level="sequence")
    assert st["ratio_mean"] == pytest.approx(math.exp(0.15))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(logps, None, gen, torch.ones(1), mask, beta=0.0, eps_low=0.2, eps_high=0.2,
                  aggregation="seq_mean", max_new_tokens=3, importance_sampling_level="group")


def reinforce_pp_reference(groups: list[list[float]]) -> list[float]:
    """r - group mean, then (x - batch mean) / (batch population std + 1e-8), in float64 loops."""
    centred = []
    for g in groups:
        m = sum(g) / len(g)
        centred += [r - m for r in g]
    mean = sum(centred) / len(centred)
    std = math.sqrt(sum((x - mean) ** 2 for x in centred) / len(centred))
    return [(x - mean) / (std + 1e-8) for x in centred]


def test_reinforce_pp_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    groups = [torch.randn(8, generator=g, dtype=torch.float64) * s for s in (0.1, 1.0, 5.0)]
    centred = torch.cat([group_advantages(r, "reinforce_pp").double() for r in groups])
    got = reinforce_pp_advantages(centred)
    want = reinforce_pp_reference([r.tolist() for r in groups])
    diff = float((got - torch.tensor(want)).abs().max())
    print(f"REINFORCE++ advantages: max abs diff {diff:.2e}")
    assert diff < 1e-6  # group_advantages centres in float32 (as the rollouts do)
    # unlike per-group std scaling, a low-variance group keeps small advantages
    assert got[:8].abs().max() < got[16:].abs().max()


def test_reinforce_pp_all_reduce_gives_the_global_statistics():
    """Two ranks each holding half the batch normalise exactly as one rank holding all of it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, generator=g, dtype=torch.float64)
    halves = [x[:8], x[8:]]

    def fake_all_reduce_for(rank):
        def reduce(t):
            other = halves[1 - rank].double()
            t += torch.stack([other.sum(), (other * other).sum(), torch.tensor(8.0, dtype=torch.float64)])
        return reduce

    got = torch.cat([reinforce_pp_advantages(halves[r], all_reduce=fake_all_reduce_for(r)) for r in range(2)])
    assert float((got - reinforce_pp_advantages(x)).abs().max()) < 1e-12


def test_reinforce_pp_loss_gradient_against_reference():
    """The loss with REINFORCE++ advantages: value and gradient against the float64 oracle of test_grpo."""
    from test_grpo import reference_loss

    logps, ref, gen, adv, mask = random_inputs(5, B=8, T=4)
    adv = reinforce_pp_advantages(group_advantages(adv, "reinforce_pp").double())
    x = logps.clone().requires_grad_(True)
    loss = grpo_loss(x, ref, gen, adv, mask, beta=0.04, eps_low=0.2, eps_high=0.2, aggregation="token_mean",
                     max_new_tokens=4)
    (grad,) = torch.autograd.grad(loss, x)
    args = (ref.numpy(), gen.numpy(), adv.numpy(), mask.numpy(), 0.04, 0.2, 0.2, "token_mean", 4)
    assert float(loss.detach()) == pytest.approx(reference_loss(logps.numpy(), *args), abs=1e-12)
    h, worst = 1e-6, 0.0
    for i in range(8):
        for t in range(4):
            plus, minus = logps.clone(), logps.clone()
            plus[i, t] += h
            minus[i, t] -= h
            fd = (reference_loss(plus.numpy(), *args) - reference_loss(minus.numpy(), *args)) / (2 * h)
            worst = max(worst, abs(float(grad[i, t]) - fd))
    print(f"REINFORCE++ loss gradient: max abs diff {worst:.2e}")
    assert worst < 1e-6


def overlong_reference(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO eq. 13 times the penalty factor, as written in the paper."""
    expected = max_new_tokens - buffer
    if length <= expected:
        return 0.0
    if length <= max_new_tokens:
        return penalty * (expected - length) / buffer
    return -penalty


@pytest.mark.parametrize("buffer,penalty", [(4, 1.0), (1, 0.5), (16, 2.0), (0, 1.0)])
def test_overlong_penalty_matches_paper(buffer, penalty):
    lens = torch.arange(0, 17)
    got = overlong_penalty(lens, 16, buffer, penalty)
    want = [overlong_reference(int(n), 16, buffer, penalty) if buffer else 0.0 for n in lens]
    diff = max(abs(a - b) for a, b in zip(got.tolist(), want))
    print(f"overlong buffer={buffer} penalty={penalty}: max abs diff {diff:.2e}")
    assert diff < 1e-6
    assert got[-1] == pytest.approx(-penalty if buffer else 0.0)


def test_overlong_shaping_changes_the_advantages():
    """Equal rewards, different lengths: the shaped group has a spread, and the longest completion loses."""
    from trainer.objective.grpo import has_spread

    rewards = torch.ones(4)
    lens = torch.tensor([3, 10, 14, 16])
    shaped = rewards + overlong_penalty(lens, 16, 8, 1.0)
    assert has_spread(shaped) and not has_spread(rewards)
    adv = group_advantages(shaped, "grpo")
    assert int(adv.argmin()) == 3 and adv[0] == adv[0].clamp(min=0)
