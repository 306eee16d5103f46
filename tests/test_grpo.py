"""grpo_loss against a plain float64 re-derivation, and the sign of its gradient."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.objective.grpo import group_advantages, grpo_loss, has_spread, loss_stats


def reference_loss(logps, ref, gen, adv, mask, beta, eps_low, eps_high, aggregation, max_new_tokens) -> float:
    """The formula written out token by token in float64 numpy, independent of the torch code."""
    logps, adv, mask = np.asarray(logps, np.float64), np.asarray(adv, np.float64), np.asarray(mask, bool)
    B, T = logps.shape
    per_seq, total, count = [], 0.0, 0
    for i in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            if gen is None:
                pg = adv[i]  # REINFORCE form: exp(0) * A
            else:
                r = math.exp(logps[i, t] - gen[i, t])
                pg = min(r * adv[i], min(max(r, 1 - eps_low), 1 + eps_high) * adv[i])
            term = -pg
            if beta:
                d = ref[i, t] - logps[i, t]
                term += beta * (math.exp(d) - d - 1)
            s += term
            n += 1
        per_seq.append(s / max(n, 1))
        total += s
        count += n
    if aggregation == "seq_mean":
        return float(np.mean(per_seq))
    if aggregation == "token_mean":
        return total / max(count, 1)
    return total / (B * max_new_tokens)


def random_inputs(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    gen = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside [0.8, 1.2]
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    return logps, ref, gen, adv, mask


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "dr_grpo"])
@pytest.mark.parametrize("use_gen", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.05, 0.5)])
def test_loss_matches_float64_reference(aggregation, use_gen, beta, eps):
    for seed in range(3):
        logps, ref, gen, adv, mask = random_inputs(seed)
        got = grpo_loss(logps, ref if beta else None, gen if use_gen else None, adv, mask, beta=beta,
                        eps_low=eps[0], eps_high=eps[1], aggregation=aggregation, max_new_tokens=12)
        want = reference_loss(logps.numpy(), ref.numpy(), gen.numpy() if use_gen else None, adv.numpy(),
                              mask.numpy(), beta, eps[0], eps[1], aggregation, 12)
        assert got.dim() == 0
        assert float(got) == pytest.approx(want, abs=1e-10, rel=1e-10)


def test_float32_inputs_close_to_reference():
    logps, ref, gen, adv, mask = random_inputs(7)
    got = grpo_loss(logps.float(), ref.float(), gen.float(), adv.float(), mask, beta=0.04, eps_low=0.2,
                    eps_high=0.2, aggregation="seq_mean", max_new_tokens=9)
    want = reference_loss(logps.numpy(), ref.numpy(), gen.numpy(), adv.numpy(), mask.numpy(), 0.04, 0.2, 0.2,
                          "seq_mean", 9)
    assert float(got) == pytest.approx(want, abs=1e-5)


def test_gradient_matches_reference_by_finite_differences():
    logps, ref, gen, adv, mask = random_inputs(3, B=3, T=4)
    x = logps.clone().requires_grad_(True)
    loss = grpo_loss(x, ref, gen, adv, mask, beta=0.1, eps_low=0.2, eps_high=0.3, aggregation="token_mean",
                     max_new_tokens=4)
    (grad,) = torch.autograd.grad(loss, x)
    h = 1e-6
    for i in range(3):
        for t in range(4):
            plus, minus = logps.clone(), logps.clone()
            plus[i, t] += h
            minus[i, t] -= h
            args = (ref.numpy(), gen.numpy(), adv.numpy(), mask.numpy(), 0.1, 0.2, 0.3, "token_mean", 4)
            fd = (reference_loss(plus.numpy(), *args) - reference_loss(minus.numpy(), *args)) / (2 * h)
            assert float(grad[i, t]) == pytest.approx(fd, abs=1e-5)


def test_masked_tokens_do_not_matter():
    logps, ref, gen, adv, mask = random_inputs(11)
    kw = dict(beta=0.04, eps_low=0.2, eps_high=0.2, aggregation="seq_mean", max_new_tokens=9)
    a = grpo_loss(logps, ref, gen, adv, mask, **kw)
    noisy = torch.where(mask, logps, torch.full_like(logps, -50.0))
    b = grpo_loss(noisy, ref, gen, adv, mask, **kw)
    assert float(a) == pytest.approx(float(b), abs=1e-12)


def test_clipping_stops_gradient_outside_trust_region():
    # ratio 2 with A > 0 is clipped at 1.2: no gradient from the policy term
    logps = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    gen = torch.full((1, 1), -math.log(2), dtype=torch.float64)
    loss = grpo_loss(logps, None, gen, torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                     beta=0.0, eps_low=0.2, eps_high=0.2, aggregation="token_mean", max_new_tokens=1)
    (g,) = torch.autograd.grad(loss, logps)
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert float(g) == 0.0
    stats = loss_stats(logps.detach(), None, gen, torch.ones(1), torch.ones(1, 1, dtype=torch.bool),
                       eps_low=0.2, eps_high=0.2)
    assert stats["clip_frac"] == 1.0


def test_mu_passes_reduce_loss_and_respect_clip():
    """mu > 1: several steps on one batch against fixed gen_logps; the clipped objective stops growing."""
    torch.manual_seed(0)
    logits = torch.zeros(4, 8, requires_grad=True)
    targets = torch.randint(0, 8, (4,))
    gen = torch.log_softmax(logits.detach(), -1).gather(1, targets[:, None])  # (4, 1)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    opt = torch.optim.SGD([logits], lr=5.0)
    losses = []
    for _ in range(8):
        logps = torch.log_softmax(logits, -1).gather(1, targets[:, None])
        loss = grpo_loss(logps, None, gen, adv, mask, beta=0.0, eps_low=0.2, eps_high=0.2,
                         aggregation="seq_mean", max_new_tokens=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0]
    assert losses[-1] == pytest.approx(-0.2, abs=1e-6)  # every ratio pinned at its clip bound: 1.2*1 / 0.8*-1


def test_gradient_sign_on_a_real_model(tiny_model_dir):
    """After one step, a positive-advantage completion gets likelier and a negative one less likely."""
    from common.logprobs import sequence_logprobs
    from common.modeling import load_model

    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32", trainable=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 12), generator=g)
    plens, clens = torch.tensor([4, 4]), torch.tensor([8, 6])
    adv = torch.tensor([1.0, -1.0])
    with torch.no_grad():
        before, _ = sequence_logprobs(model, ids, plens, clens)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    logps, _ = sequence_logprobs(model, ids, plens, clens)
    mask = torch.arange(8)[None, :] < clens[:, None]
    for gen in (before, None):  # clipped-ratio form and REINFORCE form
        loss = grpo_loss(logps, before, gen, adv, mask, beta=0.04, eps_low=0.2, eps_high=0.2,
                         aggregation="seq_mean", max_new_tokens=8)
        opt.zero_grad()
        loss.backward(retain_graph=gen is not None)
    opt.step()
    with torch.no_grad():
        after, _ = sequence_logprobs(model, ids, plens, clens)
    seq = lambda lp: (lp * mask).sum(1)  # noqa: E731
    assert seq(after)[0] > seq(before)[0]
    assert seq(after)[1] < seq(before)[1]


def test_group_advantages_modes():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    np.testing.assert_allclose(group_advantages(r, "raw"), r)
    np.testing.assert_allclose(group_advantages(r, "grpo_no_std"), r - 3.0)
    np.testing.assert_allclose(group_advantages(r, "grpo"), (r - 3.0) / (np.std(r.numpy(), ddof=1) + 1e-4), rtol=1e-6)
    assert not has_spread(torch.tensor([0.5, 0.5, 0.5]))
    assert has_spread(torch.tensor([0.5, 0.5, 0.6]))
    with pytest.raises(ValueError):
        group_advantages(r, "nope")


def test_bad_arguments():
    logps, ref, gen, adv, mask = random_inputs(0)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(logps, ref, gen, adv, mask, beta=0.0, eps_low=0.2, eps_high=0.2, aggregation="sum",
                  max_new_tokens=4)
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, None, gen, adv, mask, beta=0.1, eps_low=0.2, eps_high=0.2, aggregation="seq_mean",
                  max_new_tokens=4)
