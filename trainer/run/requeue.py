"""Stop for a requeue (issue 63): a stop request ends the run at the end of the step in progress, with a checkpoint
of that step on every host, and exit code 75 (EXIT_REQUEUE).

The request is a file, OUTPUT_DIR/stop_request, that any rank may find: Slurm sends the batch shell SIGUSR1 ahead of
the time limit (`#SBATCH --signal=B:USR1@120`), examples/slurm/train.sbatch forwards it to the tasks and
`launch.sh slurm` (trainer/dist/slurm.py) writes the file on each trainer node. A file, not the signal itself: the
ranks and everything they start keep SIGUSR1 ignored (as launch.sh slurm starts them), so a signal Slurm delivers
to every process of the step ends none of them (a handler on the rank would be reset to the default, fatal action in
each process it execs). `touch RUN_DIR/stop_request` does the same by hand.

The ranks agree on the step to stop at: each rank's answer travels with the per-step gather of the examples trained
(trainer/loop.py), so every rank sees the same answer at the same step, without a collective of its own. The
requeued job resumes from that checkpoint exactly (trainer/resume.py).
"""
from __future__ import annotations

from pathlib import Path

EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped on purpose with a checkpoint; run it again to go on (common/run_record.py)
STOP_FILE = "stop_request"


class StopRequest:
    """`asked`: a stop was requested for this rank's output directory (one stat a step)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / STOP_FILE

    @property
    def asked(self) -> bool:
        return self.path.exists()


def request_stop(output_dir: str | Path) -> Path:
    """Ask the ranks writing to output_dir to stop after their step, with a checkpoint."""
    path = Path(output_dir) / STOP_FILE
    path.write_text("stop after this step with a checkpoint (exit 75)\n")
    return path


def agreed(gathered: list) -> tuple[list, bool]:
    """Split the gathered (examples, asked) pairs of every rank: (examples per rank, whether any rank was asked)."""
    return [examples for examples, _ in gathered], any(asked for _, asked in gathered)
