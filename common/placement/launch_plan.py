"""launch.sh's side of the placement plan (common/placement/plan.py): find the GPUs, read the run's config, print the
plan, write it as JSON (the ref server shows it in GET /status) and hand launch.sh its shell variables.

    python -m common.placement.launch_plan --workers 1 [--gpus N] [--ref-device D] [--no-ref] [--worker-gpus 2,3]
        [--rank-gpus 0,1] [--share-gpu] [--json RUN_DIR/placement.json] [--check-torch] -- TRAINER ARGS...

stdout: bash assignments for launch.sh to eval (PLAN_REF_ENV, PLAN_REF_DEVICE, PLAN_REF_ARGS[], PLAN_WORKER_ENV[],
PLAN_WORKER_ARGS[], PLAN_DS[], PLAN_TRAIN_ARGS[]: micro_batch_size/gradient_checkpointing picked to fit
(common/placement/memory_report.py); PLAN_ALL_ARGS[]: trainer args for every process (train_batch_groups when one
CPU rank takes the step of two: common/placement/cpu_ranks.py); PLAN_REF_MODEL: the config's ref_model or model,
PLAN_OUTPUT_DIR: the output_dir the user gave, PLAN_JSON: RUN_DIR/placement.json's text); stderr: the plan and its
memory estimate, for people. launch.sh reads the config only here: one Python start for both (each costs ~0.3
CPU-s). A worker host (`launch.sh workers`, trainer/dist/hosts.py) calls plan_for / announce / worker_launch
from Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from common.placement.cpu_ranks import auto_cpu_ranks
from common.placement.cuda import device_count
from common.placement.gen_choice import resolve_machine
from common.placement.memory_report import Report, memory_report
from common.placement.plan import Placed, Plan, describe, flag_word, plan_placement
from common.settings.argparser import ArgumentParser
from common.settings.gen_defaults import SHOWN, resolve_generation


def smi_uuids(text: str) -> tuple[list[int], dict[str, int]]:
    """`nvidia-smi -L` -> (physical GPU indices, {GPU or MIG UUID: its GPU's index})."""
    found, uuids, gpu = [], {}, None
    for line in text.splitlines():
        m = re.match(r"GPU (\d+):.*?(?:\(UUID: (GPU-[^)\s]+)\))?\s*$", line)
        if m:
            gpu = int(m.group(1))
            found.append(gpu)
            if m.group(2):
                uuids[m.group(2)] = gpu
            continue
        m = re.match(r"\s+MIG .*\(UUID: (MIG-[^)\s]+)\)", line)
        if m and gpu is not None:
            uuids[m.group(1)] = gpu
    return found, uuids


def visible_gpus(visible: str, found: list[int], uuids: dict[str, int]) -> tuple[list[int], dict[int, str]]:
    """CUDA_VISIBLE_DEVICES as indices (0,1), GPU UUIDs (GPU-8f2b..., a unique prefix is enough, as CUDA takes)
    or MIG instances (MIG-..., MIG-GPU-<uuid>/gi/ci) -> (the plan's GPU numbers, {number: the name a process is
    given}). A whole GPU named by UUID becomes its index; a MIG instance keeps its name (it is not a GPU index)
    and gets a number of its own past the physical GPUs."""
    out, names = [], {}
    for i, v in enumerate(x.strip() for x in visible.split(",") if x.strip()):
        if v.isdigit():
            if int(v) in found:
                out.append(int(v))
            continue
        hits = sorted({g for u, g in uuids.items() if u.startswith(v) and u.startswith("GPU-")}) if \
            v.startswith("GPU-") else []
        if v.startswith("GPU-") and len(hits) == 1:
            out.append(hits[0])
        elif v.startswith("MIG-") and (v in uuids or v[4:].split("/")[0] in uuids):
            slot = max(found, default=-1) + 1 + i  # a number no physical GPU has
            out.append(slot)
            names[slot] = v
        else:
            raise ValueError(f"CUDA_VISIBLE_DEVICES names {v!r}, which `nvidia-smi -L` does not list (as a GPU index, "
                             f"a GPU UUID or a MIG instance)" + (" unambiguously" if len(hits) > 1 else ""))
    return out, names


def detect_gpus() -> tuple[list[int], str, dict[int, str]]:
    """(GPU numbers this launcher may use, how they were found, {number: CUDA_VISIBLE_DEVICES name} for MIG
    instances). `nvidia-smi -L` when it is on PATH (no CUDA initialised here), else torch; CUDA_VISIBLE_DEVICES,
    when set, narrows them (indices, GPU UUIDs or MIG instances: visible_gpus)."""
    smi = shutil.which("nvidia-smi")
    uuids: dict[str, int] = {}
    if smi:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
        found, uuids = smi_uuids(out.stdout) if out.returncode == 0 else ([], {})
        how = f"nvidia-smi -L ({smi})" if out.returncode == 0 else \
            f"nvidia-smi -L failed (exit {out.returncode}: {out.stderr.strip()[:200]}), so no GPU is used"
    else:
        found, how = list(range(device_count())), "torch.cuda.device_count() (no nvidia-smi on PATH)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found, how, {}
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if smi:  # nvidia-smi lists physical GPUs (and their UUIDs): keep the visible ones
        gpus, names = visible_gpus(visible, found, uuids)
        return gpus, f"{how}, narrowed by CUDA_VISIBLE_DEVICES={visible}", names
    if not all(v.isdigit() for v in items):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs by UUID or MIG instance: the placement plan "
                         f"maps them with `nvidia-smi -L`, which is not on PATH")
    # torch counted the visible GPUs already: the first len(found) of them exist (none without CUDA)
    return [int(v) for v in items][:len(found)], f"{how}, CUDA_VISIBLE_DEVICES={visible}", {}


def named(plan: Plan, names: dict[int, str]) -> Plan:
    """The plan with MIG instances given by name (CUDA_VISIBLE_DEVICES=MIG-...). DeepSpeed's --include takes GPU
    indices only, so ranks on a MIG instance are refused (run them on whole GPUs, or only workers on this host)."""
    if not names:
        return plan
    if plan.ranks and any(g in names for g in plan.ranks.gpus):
        raise ValueError("the trainer ranks would run on MIG instances, which deepspeed --include cannot name: give "
                         "the ranks whole GPUs (--rank-gpus), or run only workers here (launch.sh workers)")
    fix = lambda p: p if p is None or not p.gpus else dataclasses.replace(  # noqa: E731
        p, cuda_visible_devices=",".join(names.get(g, str(g)) for g in p.gpus))
    return dataclasses.replace(plan, ref=fix(plan.ref), workers=tuple(fix(w) for w in plan.workers))


def gpu_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1,2 (got {text!r})") from None


def worker_launch(w: Placed) -> tuple[str, list[str]]:
    """A worker's environment prefix (CUDA_VISIBLE_DEVICES=..., or "" to leave it) and its extra trainer/main.py
    arguments: what `launch.sh train` and `launch.sh workers` start it with, and what --print-plan shows."""
    env = f"CUDA_VISIBLE_DEVICES={w.cuda_visible_devices}" if w.cuda_visible_devices is not None else ""
    extra = [] if not w.gpus else ["--device", w.device]
    for k, v in w.gen:  # the generation settings resolved for its device (common/settings/gen_defaults.py)
        extra += [f"--{k}", flag_word(v)]
    if not w.gen and w.vllm_gpu_memory_utilization is not None:
        extra += ["--vllm_gpu_memory_utilization", f"{w.vllm_gpu_memory_utilization:g}"]
    if w.waits_for_ranks:  # shares a GPU with the ranks: vLLM profiles once they are up (docs/gpus.md)
        extra += ["--wait_for_ranks", str(w.waits_for_ranks)]
    if w.starts_after:  # shares a GPU with earlier vLLM workers: starts once they are up
        extra += ["--start_after", ",".join(w.starts_after)]
    return env, extra


def plan_line(w: Placed) -> str:
    """`worker0: CUDA_VISIBLE_DEVICES=2 --device cuda:0`: one worker of --print-plan (launch.sh train prints the
    same from the shell variables)."""
    env, extra = worker_launch(w)
    return f"{w.name}: {env or '(environment unchanged)'} {' '.join(extra)}"


def plan_for(cfg, gpus: list[int], **kwargs) -> Plan:
    """plan_placement for a run's config: its vLLM fraction (when the user set one), whether the workers run vLLM,
    GPUs per worker (vllm_tensor_parallel_size); then each worker's generation settings resolved for its device
    (Placed.gen: what it is started with, what --print-plan shows). bf16, vllm_dtype and gen_backend auto are
    resolved for this machine first (common/placement/gen_choice.py), the lines saying so among the plan's notes."""
    auto_backend = cfg.gen_backend == "auto"
    cfg, said = resolve_machine(cfg, cuda=bool(gpus), probe_gpu=False)  # bf16, vllm_dtype, gen_backend auto
    user_fraction = cfg.vllm_gpu_memory_utilization
    if user_fraction == "auto":
        user_fraction = None  # not set by the user: the plan may lower it on a shared GPU
    vllm = cfg.gen_backend == "vllm"
    plan = plan_placement(gpus, vllm_workers=vllm, vllm_fraction=user_fraction,
                          tp=cfg.vllm_tensor_parallel_size if vllm else 1, **kwargs)
    ranks = plan.num_ranks or None  # a worker host: its ranks run elsewhere (unknown here)
    placed = []
    for w in plan.workers:
        wcfg, _ = resolve_generation(cfg, cuda=bool(w.gpus), producer="worker", ranks=ranks,
                                     workers=len(plan.workers), gpu_share=w.vllm_gpu_memory_utilization)
        chosen = (("gen_backend", cfg.gen_backend),) if auto_backend else ()  # the choice, given to each worker
        placed.append(dataclasses.replace(w, gen=chosen + tuple((k, getattr(wcfg, k)) for k in SHOWN)))
    return dataclasses.replace(plan, workers=tuple(placed), notes=plan.notes + tuple(said))


def check_torch(plan: Plan, how: str) -> None:
    """GPUs planned but a torch without CUDA: say so before anything starts."""
    if plan.gpus:
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"{len(plan.gpus)} GPU(s) found ({how}) but this torch ({torch.__version__}) has "
                             f"no CUDA: install a CUDA build (GRPO_TORCH, see docs/install.md) or hide the GPUs with "
                             f"CUDA_VISIBLE_DEVICES=")


def announce(plan: Plan, how: str, json_path: str | None) -> None:
    """Print the plan for people (stderr) and write it as JSON where asked."""
    doc = dict(plan.to_json(), found_by=how)
    print("[launch] " + describe(doc).replace("\n", "\n[launch] ") + f"\n[launch]   GPUs found by: {how}",
          file=sys.stderr)
    if json_path:
        write_plan(plan, how, json_path)


def write_plan(plan: Plan, how: str, json_path: str) -> None:
    """RUN_DIR/placement.json: the plan the ref server's /status shows."""
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(plan_json(plan, how) + "\n")


def plan_json(plan: Plan, how: str) -> str:
    return json.dumps(dict(plan.to_json(), found_by=how), indent=1)


def given_output_dir(args: list[str]) -> str:
    """The output_dir the user gave: the last --output_dir among the trainer args, else the --config file's; ""
    when neither (launch.sh then makes runs/<timestamp>)."""
    given = files = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if name.replace("-", "_") == "__output_dir":
            given = value
        elif name == "--config":
            files = value
    if given is None and files:
        with open(files) as f:
            given = json.load(f).get("output_dir")
    return given or ""


def shell_vars(plan: Plan, ref_args: list[str] | None = None) -> str:
    """The bash assignments launch.sh evals: each process's environment prefix and extra arguments.
    `ref_args`: the ref server's extra flags (PLAN_REF_ARGS): how the trainer's config loads the model
    (trust_remote_code, attn_implementation, revision, model_init_kwargs), so the ref server loads it alike."""
    q = shlex.quote
    ref = plan.ref
    ref_env = f"CUDA_VISIBLE_DEVICES={ref.cuda_visible_devices}" if ref and ref.cuda_visible_devices is not None else ""
    lines = [f"PLAN_REF_ENV={q(ref_env)}", f"PLAN_REF_DEVICE={q(ref.device if ref else '')}"]
    envs, args = [], []
    for w in plan.workers:
        env, extra = worker_launch(w)
        envs.append(q(env))
        args.append(q(" ".join(extra)))
    lines += [f"PLAN_REF_ARGS=({' '.join(q(a) for a in ref_args or [])})"]
    lines += [f"PLAN_WORKER_ENV=({' '.join(envs)})", f"PLAN_WORKER_ARGS=({' '.join(args)})",
              f"PLAN_DS=({' '.join(q(a) for a in plan.deepspeed_args)})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = ArgumentParser(prog="python -m common.placement.launch_plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gpus", type=int, default=None, help="DeepSpeed ranks (default: the GPUs left; on CPU 1 or 2, "
                   "common/placement/cpu_ranks.py)")
    p.add_argument("--ref-device", default="auto")
    p.add_argument("--no-ref", action="store_true", help="the ref server runs elsewhere (--ref-url)")
    p.add_argument("--worker-gpus", type=gpu_list, default=None)
    p.add_argument("--rank-gpus", type=gpu_list, default=None)
    p.add_argument("--share-gpu", action="store_true")
    p.add_argument("--json", default=None, help="write the plan here (the ref server's --placement-file)")
    p.add_argument("--check-torch", action="store_true", help="fail when GPUs are planned but torch has no CUDA")
    p.add_argument("--ref-model", default=None, help="the ref server's model, for the memory estimate (default: "
                   "the config's ref_model, else its model)")
    p.add_argument("--ref-dtype", default="auto", help="the ref server's dtype, for the memory estimate")
    a = p.parse_args(argv)
    from common.config import GRPOConfig
    from common.settings.knobs import load_config_or_exit

    cfg = load_config_or_exit(GRPOConfig, rest, prog="trainer/main.py")  # a bad config: one line, exit 2
    ref_model = a.ref_model or cfg.ref_model or cfg.model
    try:
        if a.gpus is not None and a.gpus < 1:
            raise ValueError(f"--gpus {a.gpus}: a run needs at least one rank")
        gpus, how, names = detect_gpus()
        ranks, batch_args, ranks_said = a.gpus, [], ()
        if a.gpus is None and not gpus:  # CPU, no --gpus: one rank or two, as measured (common/placement/cpu_ranks.py)
            ranks, batch_args, said = auto_cpu_ranks(cfg)
            ranks_said = (said,)
            cfg = load_config_or_exit(GRPOConfig, rest + batch_args, prog="trainer/main.py")
        plan = named(plan_for(cfg, gpus, workers=a.workers, ranks=ranks, ref_device=a.ref_device,
                              start_ref=not a.no_ref, worker_gpus=a.worker_gpus, rank_gpus=a.rank_gpus,
                              share=a.share_gpu), names)
        plan = dataclasses.replace(plan, notes=ranks_said + plan.notes)
        cfg = resolve_machine(cfg, cuda=bool(plan.gpus), probe_gpu=False)[0]  # as plan_for did (its notes say)
        if a.check_torch:
            check_torch(plan, how)
    except ValueError as e:
        print(f"[launch] placement: {e}", file=sys.stderr)
        return 2
    announce(plan, how, None)
    # the ranks' own generation (HF, when no worker batch is there in time) as resolved on their device
    rank_cfg, _ = resolve_generation(cfg, cuda=bool(plan.gpus), producer="rank", ranks=plan.num_ranks)
    memory = memory_report(rank_cfg, plan, ref_model, a.ref_dtype) if plan.gpus else Report()  # CPU: no estimate
    for line in memory.lines:
        print(f"[launch] {line}", file=sys.stderr)
    if memory.refusal:
        print(f"[launch] memory: {memory.refusal}", file=sys.stderr)
        return 2
    if a.json:
        write_plan(plan, how, a.json)
    print(shell_vars(plan, cfg.cli_args() + cfg.reward_model_server_args()))  # the ref server holds the reward models
    train_args = memory.trainer_args + (["--gen_wait_for_workers", ",".join(plan.ranks_wait_for)]
                                        if plan.ranks_wait_for else [])  # not generating while they start
    print(f"PLAN_TRAIN_ARGS=({' '.join(shlex.quote(x) for x in train_args)})")  # values picked to fit
    print(f"PLAN_ALL_ARGS=({' '.join(shlex.quote(x) for x in batch_args)})")  # every process's: the step's groups
    print(f"PLAN_REF_MODEL={shlex.quote(ref_model)}\nPLAN_OUTPUT_DIR={shlex.quote(given_output_dir(rest))}\n"
          f"PLAN_JSON={shlex.quote(plan_json(plan, how))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
