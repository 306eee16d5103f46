"""The distributed wing: what changes when ranks span GPUs and hosts. `comm.py` runs every tensor collective
on the device its process group serves (NCCL: CUDA, gloo: CPU); `nodes.py` knows a rank's host (node rank,
local rank, the node leader that writes the host's own run directory, the address towards a peer);
`hosts.py` is the per-host launch behind `./launch.sh ref-server | trainer-host | workers`.
"""
