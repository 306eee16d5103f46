"""The run wing: watching a run. `health.py` heartbeats to the ref server and each rank's watchdog;
`stall.py` says so when nothing trains and stops what never can; `start_order.py` reads who is up from the ref
server's /status; `step_metrics.py` is what a step logs and its reduction over ranks, `metrics.py` where the rows
go (JSONL, TensorBoard, W&B); `completions.py` the sample completions in the run directory; `child_pipe.py` reads a
child process's JSON lines under a deadline (tool executor, reward worker); `rollout_stats.py` what a generation
round did, merged one way.
"""
