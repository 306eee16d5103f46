"""`python -m trainer.demo`: see trainer/demo/cli.py."""
from trainer.demo.cli import run

run()
