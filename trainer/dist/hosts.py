"""One command per host role (issue 23): what `./launch.sh ref-server | trainer-host | workers` runs.

    ./launch.sh ref-server   --host 10.0.0.1 --token-file secret.txt --ref-model M [-- --trust_remote_code true]
    ./launch.sh trainer-host --nodes 2 --node-rank R --master-addr 10.0.0.2 --master-port 29511 \
                             --ref-url http://10.0.0.1:59875 --token-file secret.txt --workers 1 -- --model M ...
    ./launch.sh workers      --ref-url http://10.0.0.1:59875 --token-file secret.txt --workers 1 -- --model M ...
    ./launch.sh workers      --workers 4 --print-plan -- --gen_backend vllm     # which GPU each would get

A worker host places its workers as `launch.sh train` does (common/placement/plan.py): each on GPU(s) of its own
(vllm_tensor_parallel_size per worker), from the highest GPU down, or --worker-gpus; the plan is printed at
start and written to RUN_DIR/placement.json.

Each host keeps its own --run-dir (no shared filesystem): the ref server relays the policy weights to the
workers over HTTP, every trainer host writes its own ranks' DeepSpeed shards there (and its own `latest`),
rank 0's host also the HF checkpoints, `final` and metrics. `--resume true` (after --) on every trainer
host continues from each host's own run directory. Trainer hosts run DeepSpeed's own launcher in its
per-node mode (`deepspeed --no_ssh --node_rank R`; no ssh between hosts): start one per host, in any order.
Relative paths are taken from where launch.sh is run (GRPO_CALLER_DIR).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.settings.argparser import ArgumentParser, canonical
from common.wire.client import RefServerError
from common.placement.launch_plan import gpu_list
from trainer.dist.nodes import address_towards, interface_of

ROOT = Path(__file__).resolve().parents[2]  # the repository: trainer/dist/hosts.py
PATH_FLAGS = ("--model", "--ref_model", "--data", "--ds_config", "--sync_dir")


def caller_path(p: str | None) -> str | None:
    """A path the user typed, relative to where they ran launch.sh."""
    if not p or os.path.isabs(p):
        return p
    return str(Path(os.environ.get("GRPO_CALLER_DIR", os.getcwd())) / p)


def trainer_args(extra: list[str]) -> list[str]:
    """Arguments after `--`: path-valued flags that name something where the user is are made absolute."""
    out = list(extra)
    for i, a in enumerate(out[:-1]):
        if canonical(a) in PATH_FLAGS and os.path.exists(caller_path(out[i + 1]) or ""):
            out[i + 1] = caller_path(out[i + 1])
    return out


def common_flags(p: argparse.ArgumentParser, run_dir: bool = True, run_dir_required: bool = True) -> None:
    p.add_argument("--token-file", help="bearer token file (required by a server bound off loopback); "
                                        "default: $GRPO_REF_TOKEN")
    if run_dir:
        p.add_argument("--run-dir", required=run_dir_required, help="this host's own run directory (logs, checkpoints)")


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launch.sh's own options, the trainer's: what follows `--`)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_extra(argv)
    p = ArgumentParser(prog="launch.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("ref-server", help="the reference model server (python -m ref_server)")
    r.add_argument("--host", required=True, help="address to bind, reachable from the other hosts")
    r.add_argument("--port", type=int, default=59875)
    r.add_argument("--ref-model", required=True, help="reference model (HF id, local directory or 'tiny')")
    r.add_argument("--ref-device", default="auto")
    r.add_argument("--ref-dtype", default="auto")
    common_flags(r, run_dir=False)
    t = sub.add_parser("trainer-host", help="this host's DeepSpeed ranks (deepspeed --no_ssh --node_rank R)")
    t.add_argument("--nodes", type=int, required=True, help="number of trainer hosts")
    t.add_argument("--node-rank", type=int, required=True, help="this host's rank among them (0 = rank 0's host)")
    t.add_argument("--master-addr", required=True, help="rendezvous address: trainer host 0's address")
    t.add_argument("--master-port", type=int, default=29500, help="rendezvous port on trainer host 0")
    t.add_argument("--gpus", type=int, default=None, help="ranks per trainer host (default: GPUs, 1 on CPU)")
    t.add_argument("--ref-url", required=True, help="the ref server's URL (several: comma-separated)")
    t.add_argument("--workers", type=int, default=0, help="genonly workers in the whole run (any host): rank 0 "
                                                           "publishes weights to them when > 0")
    t.add_argument("--config", help="trainer config JSON")
    common_flags(t)
    w = sub.add_parser("workers", help="genonly workers on this host")
    w.add_argument("--ref-url", help="the ref server's URL (required unless --print-plan)")
    w.add_argument("--workers", type=int, default=1, help="workers to start on this host")
    w.add_argument("--first-id", type=int, default=0, help="worker id of the first (ids are unique in a run)")
    w.add_argument("--config", help="trainer config JSON")
    w.add_argument("--worker-gpus", type=gpu_list, default=None,
                   help="GPU indices for the workers, in order, vllm_tensor_parallel_size each (e.g. 0,1; default: "
                        "from the highest GPU down)")
    w.add_argument("--share-gpu", action="store_true", help="let workers share GPUs (vLLM's memory fraction is "
                                                            "lowered to fit)")
    w.add_argument("--print-plan", action="store_true", help="print which GPU(s) each worker would get and exit "
                                                             "without starting anything")
    w.add_argument("--keep-going", action="store_true", help="a worker that exits does not stop the others (a "
                                                             "loud line; /status shows it exited); default: the "
                                                             "first that fails stops them all, naming itself")
    common_flags(w, run_dir_required=False)  # not needed to print a plan
    args = p.parse_args(argv)
    if args.role == "workers" and not args.print_plan and not (args.ref_url and args.run_dir):
        w.error("--ref-url and --run-dir are required (unless --print-plan)")
    return args, trainer_args(extra)


def token_env(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if args.token_file:
        env["GRPO_REF_TOKEN"] = Path(caller_path(args.token_file)).read_text().strip()
    return env


def ref_server(args: argparse.Namespace, extra: list[str] = ()) -> list[str]:
    """`extra` (after --): more ref server options, e.g. how the model loads (--trust_remote_code true,
    --revision R: the trainer hosts' options of the same names)."""
    cmd = [sys.executable, "-m", "ref_server", "--model", caller_path(args.ref_model) if
           os.path.exists(caller_path(args.ref_model)) else args.ref_model, "--host", args.host,
           "--port", str(args.port), "--device", args.ref_device, "--dtype", args.ref_dtype]
    return cmd + (["--token-file", caller_path(args.token_file)] if args.token_file else []) + list(extra)


def trainer_host(args: argparse.Namespace, extra: list[str], env: dict) -> list[str]:
    """deepspeed in its per-node mode: a hostfile naming every node (slots = ranks per node), this node's rank."""
    from common.placement.cuda import device_count  # torch's count; no torch import on a CPU build (then exec'd)

    if not 0 <= args.node_rank < args.nodes:
        raise SystemExit(f"--node-rank must be in 0..{args.nodes - 1}, got {args.node_rank}")
    gpus = args.gpus or device_count() or 1
    run_dir = Path(caller_path(args.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stop_request").unlink(missing_ok=True)  # an earlier attempt's (trainer/run/requeue.py)
    hostfile = run_dir / "hostfile"
    hostfile.write_text("".join(f"node{i} slots={gpus}\n" for i in range(args.nodes)))
    # gloo/NCCL pick their interface from the hostname, which may resolve to loopback or to another
    # network: use the one that reaches the rendezvous address (unless the user chose one)
    ifname = interface_of(address_towards(args.master_addr))
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if ifname and not env.get(var):
            env[var] = ifname
    cfg = ["--config", caller_path(args.config)] if args.config else []
    launcher = Path(sys.executable).parent / "deepspeed"  # the venv's, as launch.sh puts it first on PATH
    return [str(launcher) if launcher.is_file() else "deepspeed", "--hostfile", str(hostfile), "--no_ssh",
            "--node_rank", str(args.node_rank),
            "--master_addr", args.master_addr, "--master_port", str(args.master_port),
            str(ROOT / "trainer" / "main.py"), *cfg, *extra, "--ref_server", args.ref_url,
            "--num_gen_workers", str(args.workers), "--output_dir", str(run_dir)]


def worker_plan(args: argparse.Namespace, cfg_args: list[str], extra: list[str]):
    """This host's placement (common/placement/plan.py): its workers only, no ref server, no ranks. Printed; written to
    RUN_DIR/placement.json when the workers start."""
    from common.config import GRPOConfig
    from common.settings.knobs import load_config
    from common.placement.launch_plan import announce, check_torch, detect_gpus, named, plan_for

    cfg = load_config(GRPOConfig, [*cfg_args, *extra])
    gpus, how, names = detect_gpus()
    plan = named(plan_for(cfg, gpus, workers=args.workers, ranks=0, start_ref=False, worker_gpus=args.worker_gpus,
                          share=args.share_gpu, first_worker=args.first_id), names)
    if not args.print_plan:
        check_torch(plan, how)
    announce(plan, how, None if args.print_plan else str(Path(caller_path(args.run_dir)) / "placement.json"))
    return plan


def workers(args: argparse.Namespace, extra: list[str], env: dict) -> int:
    """Start the workers (each logs to RUN_DIR/workerN.log), wait for all; a signal stops them all."""
    from common.placement.launch_plan import plan_line, worker_launch

    cfg = ["--config", caller_path(args.config)] if args.config else []
    try:
        plan = worker_plan(args, cfg, extra)
    except ValueError as e:
        print(f"[launch] placement: {e}", file=sys.stderr)
        return 2
    if args.print_plan:  # what each worker would be started with; nothing is started
        print("\n".join(plan_line(w) for w in plan.workers))
        return 0
    run_dir = Path(caller_path(args.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for wid, placed in zip(range(args.first_id, args.first_id + args.workers), plan.workers):
        where, plan_args = worker_launch(placed)
        wenv = dict(env)
        if where:  # CUDA_VISIBLE_DEVICES=...: this worker sees only its GPU(s)
            key, value = where.split("=", 1)
            wenv[key] = value
        cmd = [sys.executable, str(ROOT / "trainer" / "main.py"), "genonly", *cfg, *extra, *plan_args,
               "--ref_server", args.ref_url, "--worker_id", str(wid), "--output_dir", str(run_dir)]
        with open(run_dir / f"worker{wid}.log", "ab") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=wenv, stdout=log, stderr=subprocess.STDOUT))
        given = " ".join([where, *plan_args]).strip()
        print(f"[launch] worker{wid} (pid {procs[-1].pid}) -> {run_dir}/worker{wid}.log"
              + (f" ({given})" if given else ""), file=sys.stderr)

    def stop(signum, _frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return watch({f"worker{args.first_id + i}": p for i, p in enumerate(procs)}, run_dir, args.ref_url,
                 args.keep_going, stop)


def watch(procs: dict, run_dir: Path, ref_url: str, keep_going: bool, stop) -> int:
    """Until every worker has exited: one that fails is named with its exit code and last log lines, and stops
    the others (exit 3), unless keep_going (a loud line, and its row in the ref server's /status says so)."""
    from trainer.dist.exits import last_lines, mark_exited

    alive, failed = dict(procs), {}
    while alive:
        for name, p in list(alive.items()):
            code = p.poll()
            if code is None:
                continue
            del alive[name]
            if code == 0:
                print(f"[launch] {name} finished (exit 0)", file=sys.stderr)
                continue
            failed[name] = code
            print(f"[launch] {name} exited with code {code}; last lines of {run_dir}/{name}.log:\n"
                  f"{last_lines(run_dir / f'{name}.log')}", file=sys.stderr)
            if not keep_going:
                print(f"[launch] stopping the other workers ({name} failed; --keep-going to go on without it)",
                      file=sys.stderr)
                stop(signal.SIGTERM, None)
                for q in alive.values():
                    q.wait()
                return 3
            print(f"[launch] !!! --keep-going: this host goes on WITHOUT {name}", file=sys.stderr)
            try:
                mark_exited(ref_url, name, code)
            except RefServerError as e:  # the loud line above stands; the status row is a courtesy
                print(f"[launch] could not mark {name} exited in /status: {e.message}", file=sys.stderr)
        time.sleep(0.5)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    env = token_env(args)
    if args.role == "workers":
        return workers(args, extra, env)
    cmd = ref_server(args, extra) if args.role == "ref-server" else trainer_host(args, extra, env)
    print("[launch] " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    os.chdir(ROOT)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
