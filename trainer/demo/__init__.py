"""The demo: DeepSeek-R1-Zero/R1 in miniature on a CPU (`python -m trainer.demo`, `./launch.sh demo`).

    cli.py      the command line and the order of the phases
    phases.py   cold-start SFT, held-out evaluation, the GRPO run through `launch.sh train`, the report
    arith.py    the synthetic task `a o b o c` (data source "arith") and its worked solutions
    sft.py      cold-start supervised fine-tuning (`python -m trainer.demo.sft`)
    plot.py     the figure: reward per step, held-out accuracy, KL to the reference

Nothing below the demo imports it: data loading reaches the synthetic task by name (trainer/data.py).
"""
