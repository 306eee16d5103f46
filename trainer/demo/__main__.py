"""`python -m trainer.demo`: see trainer/demo/cli.py."""
from common.fast_exit import exit_cleanly
from trainer.demo.cli import run

run()
exit_cleanly(0)  # done, its run stopped and waited for: skip the interpreter's teardown (common/fast_exit.py)
