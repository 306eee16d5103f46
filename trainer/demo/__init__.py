"""The demo: DeepSeek-R1-Zero/R1 in miniature on a CPU (`python -m trainer.demo`, `./launch.sh demo`).

    cli.py      the command line and the order of the phases
    phases.py   cold-start SFT, held-out evaluation, the GRPO run through `launch.sh train`, the report
    arith.py    the synthetic task `a o b o c` (data source "arith") and its worked solutions
    sft.py      cold-start supervised fine-tuning (`python -m trainer.demo.sft`)
    plot.py     the figure: reward per step, held-out accuracy, KL to the reference
    tool_task.py    --tools: the task `ab*cd+e` (data source "arith_tools") and its reward
    tool_sft.py     --tools: SFT traces with and without a calculator call, tokenised as the tool loop builds them
    tool_phases.py  --tools: SFT on them, evaluation with and without tools (tool_report.py: its table and summary keys)

Nothing below the demo imports it: data loading reaches the synthetic task by name (trainer/data/loading.py).
"""
