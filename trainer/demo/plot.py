"""The demo's figure: reward per step, held-out accuracy before/during/after, KL to the reference."""
from __future__ import annotations

from pathlib import Path


def make_plot(metrics: list[dict], before: dict, after: dict, steps: int, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in metrics if "reward_mean" in r]
    xs = [r["step"] for r in train]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    rew = [r["reward_mean"] for r in train]
    ax.plot(xs, rew, color="tab:blue", alpha=0.3, lw=1, label="per step")
    if rew:
        w = max(1, len(rew) // 15)
        smooth = [sum(rew[max(0, i - w + 1):i + 1]) / len(rew[max(0, i - w + 1):i + 1]) for i in range(len(rew))]
        ax.plot(xs, smooth, color="tab:blue", lw=2.5, label=f"running mean ({w} steps)")
    ax.set_title("Reward per step (correct ±1 + format 1.25/−1)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of the training batch")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    mid = [(r["step"], r["eval_accuracy"]) for r in metrics if "eval_accuracy" in r and 0 < r["step"] < steps]
    pts = [(0, before["accuracy"])] + mid + [(steps, after["accuracy"])]
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "-", color="tab:green", lw=2)
    if mid:
        n_mid = next(r.get("eval_n") for r in metrics if "eval_accuracy" in r)
        ax.plot([p[0] for p in mid], [100 * p[1] for p in mid], "o", color="tab:green", ms=5,
                label=f"during training ({int(n_mid)} examples)" if n_mid else "during training")
    ax.plot([0, steps], [100 * before["accuracy"], 100 * after["accuracy"]], "s", color="darkgreen", ms=9,
            label=f"before / after ({before['n']} examples)")
    for x, acc, ha in ((0, before["accuracy"], "left"), (steps, after["accuracy"], "right")):
        ax.annotate(f"{100 * acc:.1f}%", (x, 100 * acc), textcoords="offset points", xytext=(0, 9), ha=ha,
                    fontsize=11, fontweight="bold")
    lo = min(100 * p[1] for p in pts)
    hi = max(100 * p[1] for p in pts)
    ax.set_ylim(max(0, lo - 10), min(100, hi + 10))
    ax.set_title("Held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("accuracy (%)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[2]
    kl = [(r["step"], r["kl"]) for r in train if "kl" in r]
    ax.plot([k[0] for k in kl], [k[1] for k in kl], color="tab:red", lw=1.5)
    ax.set_title("KL to the reference (SFT) model")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean per-token KL (k3)")
    ax.grid(alpha=0.3)

    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
