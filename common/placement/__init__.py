"""The placement plan: which GPU(s) each process gets. `plan.py` is the plan (pure), `memory_plan.py` the
memory estimate (pure), `memory_report.py` reads the GPUs and gives the verdict, `cuda.py` says whether torch
sees a GPU (a CPU build without importing it), and `launch_plan.py` is launch.sh's side
(`python -m common.placement.launch_plan`).
"""
