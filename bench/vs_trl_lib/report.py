"""bench/vs_trl.py's report of a run: which part of it each process is, the figures of one side, the ratios and the
table it prints."""
from __future__ import annotations


def say(msg: str) -> None:
    print(msg, flush=True)


def role(cmd: str) -> str:
    """Which part of a run a process is, from its command line (the ranks' carry --ref_server URL: ranks first)."""
    words = cmd.split()
    rank = [w.split("=", 1)[1] for w in words if w.startswith("--local_rank=")]
    if "trl_grpo.py" in cmd:
        return "trl"
    if rank:
        return f"rank {rank[0]}"
    if "genonly" in words:
        return "worker"
    if "deepspeed" in cmd:
        return "deepspeed launcher"
    if "-m ref_server " in cmd + " ":
        return "ref server"
    if "launch.sh" in cmd:
        return "launch.sh"
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]  # launch.sh's checks and placement plan: python -m <module>
    return (words[0].rsplit("/", 1)[-1] if words else "") or "?"


def by_role(per_process: list[dict]) -> dict:
    out: dict = {}
    for r in per_process:
        out[r["role"]] = round(out.get(r["role"], 0.0) + r["cpu_s"], 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def figures(r: dict, acc: float) -> dict:
    m = r["measured"]
    cpu = max(m.cpu_s, m.rusage_children_cpu_s)
    return dict(cpu_s=round(cpu, 1), cpu_s_sampled=m.cpu_s, cpu_s_rusage_children=m.rusage_children_cpu_s,
                wall_s=m.wall_s, steps=r["steps"], steps_per_cpu_s=r["steps"] / cpu,
                spread_groups=r["spread_groups"], spread_groups_per_cpu_s=r["spread_groups"] / cpu, accuracy=acc,
                reward_first_step=r["reward_first"], reward_last_step=r["reward_last"],
                cpu_s_by_role=by_role(m.per_process),
                per_process=[{"role": p["role"], "pid": p["pid"], "cpu_s": p["cpu_s"], "cmd": p["cmd"][:160]}
                             for p in m.per_process if p["cpu_s"] >= 0.1])


def comparisons(runs: dict) -> dict:
    """Ours against each TRL run, by its thread count: steps and spread groups per CPU-s (ours / TRL; None where
    TRL's figure is 0, a smoke run's untrained model) and the walls (ours / TRL: <= 1 is ours as fast or faster)."""
    if "ours" not in runs:
        return {}
    ours, out = runs["ours"], {}
    for name, trl in runs.items():
        if not name.startswith("trl_"):
            continue
        per = lambda k, trl=trl: ours[k] / trl[k] if trl[k] else None  # noqa: E731
        out[trl["threads"]] = dict(steps_per_cpu_s_ratio=per("steps_per_cpu_s"),
                                   spread_groups_per_cpu_s_ratio=per("spread_groups_per_cpu_s"),
                                   wall_ratio=ours["wall_s"] / trl["wall_s"], wall_s_trl=trl["wall_s"],
                                   wall_s_ours=ours["wall_s"])
    return out


def table(runs: dict, acc_sft: float, n: int) -> None:
    say(f"\n{'run':<10}{'CPU-s':>9}{'wall s':>9}{'steps/CPU-s':>13}{'spread groups/CPU-s':>21}"
        f"{f'accuracy ({n}, greedy)':>24}")
    for name, f in runs.items():
        say(f"{name:<10}{f['cpu_s']:>9.1f}{f['wall_s']:>9.1f}{f['steps_per_cpu_s']:>13.4f}"
            f"{f['spread_groups_per_cpu_s']:>21.4f}{100 * f['accuracy']:>23.1f}%")
    say(f"{'SFT start':<10}{'':>52}{100 * acc_sft:>23.1f}%")
    show = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for threads, c in comparisons(runs).items():
        say(f"ours vs TRL at {threads} thread(s): steps per CPU-s {show(c['steps_per_cpu_s_ratio'])}, spread groups "
            f"per CPU-s {show(c['spread_groups_per_cpu_s_ratio'])}, wall {c['wall_s_ours']:.1f} s vs "
            f"{c['wall_s_trl']:.1f} s ({show(c['wall_ratio'])})")
    for name, f in runs.items():
        say(f"CPU-s by process, {name}: " + ", ".join(f"{k} {v}" for k, v in f["cpu_s_by_role"].items()))
    if "resolved" in runs.get("ours", {}):
        say("ours, as resolved on this machine: " + ", ".join(f"{k} {v}" for k, v in runs["ours"]["resolved"].items()))
