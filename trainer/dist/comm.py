"""The one place that knows which device the process group's collectives serve.

On GPUs `deepspeed.init_distributed` picks NCCL, which reduces CUDA tensors only (a CPU tensor fails with
"No backend type associated with device type cpu"); on CPU we run gloo, which reduces CPU tensors. Every
tensor collective of the trainer goes through `all_reduce` here: it copies the tensor to the group's device,
reduces there and writes the result back in place, so callers keep their tensors wherever they like.
Object collectives (all_gather_object) and barriers need no tensor of ours: torch picks their device itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def comm_device() -> torch.device:
    """The device whose tensors the default process group reduces: CPU if it serves CPU (gloo), else the
    current CUDA device (NCCL; init_deepspeed has set it to the rank's local GPU)."""
    group = dist.distributed_c10d._get_default_group()
    served = {d.type for d in group._device_types}  # gloo: cpu; nccl: cuda; cpu:gloo,cuda:nccl: both
    if "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(sorted(served)[0])  # a group without CPU: its own device type (fails loudly if absent)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `t` over every rank (op: sum or max) on the group's device; returns `t`."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dev = comm_device()
    buf = t if t.device == dev else t.to(dev)
    dist.all_reduce(buf, op=ops[op])
    if buf is not t:
        t.copy_(buf)
    return t


def all_reduce_int(value: int, op: str = "max") -> int:
    """One integer agreed by every rank (max by default): for decisions every rank must take alike."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(value)
    return int(all_reduce(torch.tensor([int(value)], dtype=torch.int64), op)[0])


def is_dist_error(e: BaseException) -> bool:
    """A failed collective (a peer died or hung), as gloo or NCCL words it, or a tensor its backend cannot serve."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(k in str(e) for k in (
        "Gloo", "gloo", "NCCL", "nccl", "Connection closed by peer", "Connection reset by peer",
        "No backend type associated with device type", "ProcessGroup", "Watchdog caught collective")))


def all_gather_values(values: torch.Tensor, pad: float = -1e9) -> torch.Tensor:
    """Every rank's 1-D float tensor, concatenated (ranks may hold different counts): padded to the longest with
    `pad`, gathered, the pad dropped again, as TRL's pad_across_processes + gather (its entropies are >= 0, so a
    negative sentinel cannot collide). One rank, or no process group: the tensor itself."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    n = all_reduce_int(values.numel(), "max")
    dev = comm_device()
    buf = torch.full((n,), pad, dtype=values.dtype, device=dev)
    buf[:values.numel()] = values.to(dev)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buf)
    out = torch.cat(parts).to(values.device)
    return out[out != pad]
