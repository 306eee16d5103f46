"""Which GPU(s) each process of a run gets: the ref server, every genonly worker, the DeepSpeed ranks.

A pure function of the GPUs there are and the launcher's flags (launch.sh calls it through
common/placement/launch_plan.py, prints the plan and hands each process its CUDA_VISIBLE_DEVICES; the ref server shows
it under "placement" in GET /status). The rules:

- No GPU: the CPU plan (every process on CPU, `deepspeed --num_gpus N` CPU ranks, default 2).
- A worker host (`launch.sh workers`, trainer/dist/hosts.py) plans its workers only: no ref server, no ranks
  (`start_ref=False, ranks=0`), worker ids from `first_worker`.
- A vLLM worker spans `tp` GPUs (vllm_tensor_parallel_size, TRL's name): it gets that many, all its own.
- Every process on its own GPU(s) unless sharing is asked (`share`): the ranks take the lowest free GPUs, one
  each (DeepSpeed rank 0 on the first); the ref server the highest free one, the workers the next highest (as
  simple_GRPO puts its ref server on the last GPU). Pinned GPUs (`ref_device` cuda:N, `worker_gpus`,
  `rank_gpus`) are honoured first; two processes pinned to one GPU without `share` is an error, and so is a
  plan that needs more GPUs than there are (the message says what to change).
- With one GPU and more than one process for it, sharing is the only plan: it is chosen and said so.
- Sharing: the ranks use every GPU (or the ones asked), the ref server and the workers are placed from the last
  GPU down, cycling. A vLLM worker reserves a fixed fraction of its GPU at start, so where one shares its GPU
  its `vllm_gpu_memory_utilization` is set to fit: `share_fraction` (TRL's colocate default, 0.3) split among
  the vLLM workers there, or the user's own value when they set one and it fits.
- A vLLM worker on a GPU the ranks also use waits for the ranks to be ready before it builds its engine
  (`waits_for_ranks`, the worker's --wait_for_ranks): vLLM's memory profiling fails when another process frees
  GPU memory meanwhile, which a rank does while it initialises (docs/gpus.md); and the ranks do not generate for
  themselves until it is up (`ranks_wait_for`, their --gen_wait_for_workers). vLLM workers sharing a GPU start one
  after the other (`starts_after`, --start_after). On GPUs of its own nothing waits.
Each process sees only its GPUs (CUDA_VISIBLE_DEVICES), so inside it its first GPU is cuda:0.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

SHARE_FRACTION = 0.3  # of a shared GPU, for its vLLM workers together (TRL's colocate vllm_gpu_memory_utilization)
MAX_VLLM_TOTAL = 0.9  # what the vLLM workers of one shared GPU may reserve together when the user sets a fraction


@dataclass(frozen=True)
class Placed:
    """One process (or, for "ranks", the DeepSpeed ranks together, one GPU each)."""
    name: str                        # ref_server, worker0, worker1, ..., ranks
    gpus: tuple[int, ...]            # physical GPU indices; () = CPU
    device: str                      # what the process is told: cuda:0 (first of its visible GPUs) or cpu
    cuda_visible_devices: str | None  # None: left as it is (the CPU plan; ranks: set by deepspeed --include)
    vllm_gpu_memory_utilization: float | None = None  # set only for a vLLM worker on a shared GPU
    shares_gpu_with: tuple[str, ...] = ()
    waits_for_ranks: int = 0         # a vLLM worker sharing a GPU with the ranks: ranks to wait for (0 = none)
    # a worker's generation settings as resolved for its device (common/settings/gen_defaults.py), given to it as
    # flags; ((name, value), ...), empty until common/placement/launch_plan.py's plan_for fills it
    gen: tuple[tuple[str, object], ...] = ()
    starts_after: tuple[str, ...] = ()  # a vLLM worker: earlier vLLM workers on its GPU(s), up before it starts


@dataclass(frozen=True)
class Plan:
    gpus: tuple[int, ...]            # the GPUs there are (physical indices)
    mode: str                        # cpu, own (a GPU per process) or shared
    ref: Placed | None               # None: the ref server runs elsewhere (--ref-url)
    workers: tuple[Placed, ...]
    ranks: Placed | None             # None: no ranks on this host (a worker host)
    num_ranks: int
    notes: tuple[str, ...] = field(default=())

    @property
    def deepspeed_args(self) -> list[str]:
        """How the launcher tells deepspeed its ranks: --include pins GPUs, --num_gpus counts CPU ranks."""
        if self.ranks is None:
            return []
        if not self.ranks.gpus:
            return ["--num_gpus", str(self.num_ranks)]
        return ["--include", "localhost:" + ",".join(map(str, self.ranks.gpus))]

    @property
    def ranks_wait_for(self) -> tuple[str, ...]:
        """Workers on the ranks' GPUs: the ranks do not generate for themselves while these are starting."""
        return tuple(w.name for w in self.workers if w.waits_for_ranks)

    @property
    def idle_gpus(self) -> tuple[int, ...]:
        used = {g for p in self.processes for g in p.gpus}
        return tuple(g for g in self.gpus if g not in used)

    @property
    def processes(self) -> list[Placed]:
        return ([self.ref] if self.ref else []) + list(self.workers) + ([self.ranks] if self.ranks else [])

    def to_json(self) -> dict:
        return {"gpus": list(self.gpus), "mode": self.mode, "num_ranks": self.num_ranks,
                "deepspeed_args": self.deepspeed_args, "idle_gpus": list(self.idle_gpus), "notes": list(self.notes),
                "processes": [dict(asdict(p), gpus=list(p.gpus), shares_gpu_with=list(p.shares_gpu_with),
                                   gen=dict(p.gen), starts_after=list(p.starts_after)) for p in self.processes]}


def describe(plan: dict) -> str:
    """The plan (its to_json form) as the lines launch.sh prints and the status page shows."""
    gpus = plan["gpus"]
    head = ("placement: CPU (no GPU found)" if plan["mode"] == "cpu" else
            f"placement: {len(gpus)} GPU(s) {gpus}, " +
            ("each process on its own GPU" if plan["mode"] == "own" else "GPUs SHARED between processes"))
    lines = [head]
    for p in plan["processes"]:
        where = "cpu" if not p["gpus"] else "GPU " + ",".join(map(str, p["gpus"]))
        extra = []
        if p["name"] == "ranks":
            extra.append(f"{plan['num_ranks']} rank(s), deepspeed {' '.join(plan['deepspeed_args'])}")
        elif p["cuda_visible_devices"] is not None:
            extra.append(f"CUDA_VISIBLE_DEVICES={p['cuda_visible_devices']} --device {p['device']}")
        if p["vllm_gpu_memory_utilization"] is not None:
            extra.append(f"vllm_gpu_memory_utilization {p['vllm_gpu_memory_utilization']:g}")
        if p["shares_gpu_with"]:
            extra.append("shares with " + ", ".join(p["shares_gpu_with"]))
        if p.get("gen"):
            extra.append(" ".join(f"{k} {flag_word(v)}" for k, v in p["gen"].items()))
        if p.get("waits_for_ranks"):
            extra.append(f"builds its engine once the {p['waits_for_ranks']} rank(s) are ready")
        if p.get("starts_after"):
            extra.append(f"starts after {', '.join(p['starts_after'])} (same GPU)")
        lines.append(f"  {p['name']:<11} {where:<14} " + "; ".join(extra))
    if plan["idle_gpus"]:
        lines.append(f"  idle GPUs: {plan['idle_gpus']}")
    lines += [f"  note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def flag_word(v) -> str:
    """A flag value as the command line takes it (true/false, 0.9)."""
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _cpu_plan(workers: int, ranks: int | None, ref_device: str, start_ref: bool, pinned: bool,
              first_worker: int) -> Plan:
    if pinned:
        raise ValueError("GPUs were asked for (--worker-gpus/--rank-gpus) but no GPU was found (nvidia-smi -L)")
    if ref_device.startswith("cuda"):
        raise ValueError(f"--ref-device {ref_device} but no GPU was found (nvidia-smi -L lists none)")
    cpu = lambda name: Placed(name, (), "cpu", None)
    return Plan((), "cpu", cpu("ref_server") if start_ref else None,
                tuple(cpu(f"worker{first_worker + i}") for i in range(workers)),
                None if ranks == 0 else cpu("ranks"), ranks if ranks is not None else 2)


def _check(gpus: Sequence[int], what: str, asked: Sequence[int]) -> None:
    bad = [g for g in asked if g not in gpus]
    if bad:
        raise ValueError(f"{what} names GPU(s) {bad}, but the GPUs here are {list(gpus)}")


def plan_placement(gpus: Sequence[int], *, workers: int, ranks: int | None = None, ref_device: str = "auto",
                   start_ref: bool = True, worker_gpus: Sequence[int] | None = None,
                   rank_gpus: Sequence[int] | None = None, share: bool = False, vllm_workers: bool = True,
                   vllm_fraction: float | None = None, share_fraction: float = SHARE_FRACTION, tp: int = 1,
                   first_worker: int = 0) -> Plan:
    """The placement plan. `gpus`: the physical GPU indices there are; `ranks`: how many DeepSpeed ranks (None:
    the GPUs left, or 2 on CPU; 0: none on this host); `worker_gpus`/`rank_gpus`: pinned GPUs (`tp` per worker,
    in worker order / one per rank); `vllm_workers`: the workers run vLLM (they reserve memory); `vllm_fraction`:
    the user's vllm_gpu_memory_utilization if they set one; `tp`: GPUs per worker (vllm_tensor_parallel_size);
    `first_worker`: the first worker's id (a worker host's --first-id)."""
    gpus = tuple(gpus)
    if workers < 0 or (ranks is not None and ranks < 0) or tp < 1:
        raise ValueError(f"need workers >= 0, ranks >= 0 and tp >= 1 (got workers={workers}, ranks={ranks}, "
                         f"tp={tp})")
    if ref_device not in ("auto", "cpu") and not (ref_device.startswith("cuda:") and ref_device[5:].isdigit()):
        raise ValueError(f"--ref-device must be auto, cpu or cuda:N (got {ref_device!r})")
    if not gpus:
        return _cpu_plan(workers, ranks, ref_device, start_ref, bool(worker_gpus or rank_gpus), first_worker)
    if worker_gpus is not None and len(worker_gpus) != workers * tp:
        raise ValueError(f"--worker-gpus lists {len(worker_gpus)} GPU(s) for {workers} worker(s): give "
                         + ("one each" if tp == 1 else f"{tp} each (vllm_tensor_parallel_size {tp})"))
    if tp > len(gpus):
        raise ValueError(f"vllm_tensor_parallel_size {tp} but only {len(gpus)} GPU(s) here: a worker spans "
                         f"{tp} different GPUs")
    if ranks == 0 and rank_gpus:
        raise ValueError("--rank-gpus given for a host without ranks")
    if rank_gpus is not None:
        if ranks is not None and ranks != len(rank_gpus):
            raise ValueError(f"--gpus {ranks} but --rank-gpus lists {len(rank_gpus)} GPU(s)")
        if len(set(rank_gpus)) != len(rank_gpus):
            raise ValueError(f"--rank-gpus {list(rank_gpus)}: a GPU twice (DeepSpeed runs one rank per GPU)")
        _check(gpus, "--rank-gpus", rank_gpus)
    _check(gpus, "--worker-gpus", worker_gpus or [])
    ref_pin = int(ref_device[5:]) if ref_device.startswith("cuda:") else None
    if ref_pin is not None:
        _check(gpus, f"--ref-device {ref_device}", [ref_pin])
    ref_on_gpu = start_ref and ref_device != "cpu"
    notes: list[str] = []
    sharers = [who for who, n in (("the ref server", ref_on_gpu), ("the workers" if workers > 1 else "the worker",
                                                                   workers), ("the rank", ranks != 0)) if n]
    if not share and len(gpus) == 1 and (len(sharers) > 1 or workers > 1):
        share = True
        notes.append(f"only 1 GPU: {', '.join(sharers[:-1])} and {sharers[-1]} share it " if len(sharers) > 1 else
                     f"only 1 GPU: {sharers[0]} share it ")
        notes[-1] += "(vLLM's memory fraction is lowered to fit); with more GPUs each process gets its own"
    if share:
        if ranks is not None and rank_gpus is None and ranks > len(gpus):
            raise ValueError(f"--gpus {ranks} ranks but only {len(gpus)} GPU(s): DeepSpeed runs one rank per GPU")
        rank_g = tuple(rank_gpus) if rank_gpus is not None else () if ranks == 0 else gpus[:ranks or len(gpus)]
        down = [gpus[-1 - i % len(gpus)] for i in range(workers * tp + 1)]  # from the last GPU down, cycling
        ref_g = (ref_pin if ref_pin is not None else down[0]) if ref_on_gpu else None
        flat = list(worker_gpus) if worker_gpus is not None else down[1:] if ref_on_gpu else down[:workers * tp]
        work_g = [tuple(sorted(flat[i * tp:(i + 1) * tp])) for i in range(workers)]
        for i, gs in enumerate(work_g):
            if len(set(gs)) != tp:
                raise ValueError(f"--worker-gpus gives worker{first_worker + i} GPUs {list(gs)}: a worker spanning "
                                 f"{tp} GPUs needs {tp} different ones")
        mode = "shared"
    else:
        ref_g, work_g, rank_g = _own(gpus, workers, ranks, ref_on_gpu, ref_pin, worker_gpus, rank_gpus, tp)
        mode = "own"
    names = [f"worker{first_worker + i}" for i in range(workers)]
    return _assemble(gpus, mode, start_ref, ref_g, list(zip(names, work_g)), rank_g if ranks != 0 else None,
                     notes, vllm_workers, vllm_fraction, share_fraction)


def _own(gpus, workers, ranks, ref_on_gpu, ref_pin, worker_gpus, rank_gpus, tp):
    """A GPU per process (`tp` per worker): pinned ones first, then the ranks from the lowest free GPU, ref and
    workers from the highest."""
    pinned = ([("ref_server", ref_pin)] if ref_on_gpu and ref_pin is not None else []) + \
        [(f"worker{i // tp}", g) for i, g in enumerate(worker_gpus or [])] + [("rank", g) for g in rank_gpus or []]
    seen: dict[int, str] = {}
    for name, g in pinned:
        if g in seen:
            raise ValueError(f"GPU {g} is asked for by both {seen[g]} and {name}: pass --share-gpu to share GPUs")
        seen[g] = name
    free = [g for g in gpus if g not in seen]
    need_ref = ref_on_gpu and ref_pin is None
    need_workers = workers * tp if worker_gpus is None else 0
    need_ranks = 0 if rank_gpus is not None else (ranks if ranks is not None else max(len(free) - need_ref
                                                                                       - need_workers, 1))
    if need_ref + need_workers + need_ranks > len(free):
        raise ValueError(
            f"this run needs {int(ref_on_gpu) + workers * tp + (need_ranks or len(rank_gpus or []))} GPUs (ref "
            f"server {int(ref_on_gpu)}, workers {workers}{f' x {tp} GPUs each' if tp > 1 else ''}, ranks "
            f"{need_ranks or len(rank_gpus or [])}) but {len(gpus)} "
            f"are here{' and some are pinned' if seen else ''}: pass --share-gpu to share GPUs, or start fewer "
            f"--workers / --gpus, or put the ref server on CPU (--ref-device cpu)")
    rank_g = tuple(rank_gpus) if rank_gpus is not None else tuple(free[:need_ranks])
    high = [g for g in reversed(free) if g not in rank_g]
    ref_g = (ref_pin if ref_pin is not None else high.pop(0)) if ref_on_gpu else None
    flat = list(worker_gpus) if worker_gpus is not None else [high.pop(0) for _ in range(workers * tp)]
    return ref_g, [tuple(sorted(flat[i * tp:(i + 1) * tp])) for i in range(workers)], rank_g


def _assemble(gpus, mode, start_ref, ref_g, work_g, rank_g, notes, vllm_workers, vllm_fraction, share_fraction):
    """The Plan from each process's GPUs (`work_g`: (name, GPUs) per worker; `rank_g` None: no ranks here)."""
    users: dict[int, list[str]] = {}
    for name, gs in [("ref_server", [ref_g] if ref_g is not None else [])] + list(work_g) + \
            [("ranks", list(rank_g or ()))]:
        for g in gs:
            users.setdefault(g, []).append(name)
    others = lambda name, gs: tuple(sorted({u for g in gs for u in users[g] if u != name}))
    vllm_on = {g: sum(1 for _, gs in work_g if g in gs) for g in gpus}

    def fraction(gs: tuple[int, ...]) -> float | None:
        shared = [g for g in gs if len(users[g]) > 1]
        if not vllm_workers or not shared:
            return None  # alone on its GPU(s): the config's vllm_gpu_memory_utilization holds
        if vllm_fraction is not None:
            for g in shared:
                if vllm_fraction * vllm_on[g] > MAX_VLLM_TOTAL:
                    raise ValueError(f"vllm_gpu_memory_utilization {vllm_fraction} x {vllm_on[g]} vLLM worker(s) "
                                     f"on shared GPU {g} exceeds {MAX_VLLM_TOTAL}: lower it or give workers own GPUs")
            return vllm_fraction
        return min(round(share_fraction / vllm_on[g], 4) for g in shared)  # one fraction for all its GPUs

    ref = None
    if start_ref:
        ref = Placed("ref_server", (), "cpu", "" if gpus else None) if ref_g is None else \
            Placed("ref_server", (ref_g,), "cuda:0", str(ref_g), None, others("ref_server", [ref_g]))
    num_ranks = len(rank_g or ())
    # vLLM profiles its GPUs' free memory at start: where the ranks initialise on one of them, it waits for them
    waits = lambda gs: num_ranks if vllm_workers and any("ranks" in users[g] for g in gs) else 0
    # vLLM workers sharing a GPU start one after the other: each one's profiling must not overlap another's start
    after = lambda i, gs: tuple(n for n, hs in work_g[:i] if vllm_workers and set(hs) & set(gs))
    workers = tuple(Placed(name, gs, "cuda:0", ",".join(map(str, gs)), fraction(gs), others(name, gs), waits(gs),
                           starts_after=after(i, gs)) for i, (name, gs) in enumerate(work_g))
    ranks = None if rank_g is None else Placed("ranks", tuple(rank_g), "cuda", None, None, others("ranks", rank_g))
    shared = [g for g in gpus if len(users.get(g, [])) > 1]
    if shared:
        vllm = [g for g in shared if vllm_workers and vllm_on[g]]
        notes.append(f"GPU(s) {shared} shared between processes" + (
            f"; vLLM workers on {vllm} reserve only the vllm_gpu_memory_utilization shown (the rest is for the "
            f"others)" if vllm else ""))
    return Plan(gpus, mode, ref, workers, ranks, num_ranks, tuple(notes))
