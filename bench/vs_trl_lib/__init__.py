"""Parts of bench/vs_trl.py: trl_grpo.py (runs in TRL's own virtual environment, never imported here), trl_env.py
(creates that environment), cpu_meter.py (CPU-seconds of a process tree), report.py (the processes' roles, each
side's figures, the ratios and the table)."""
