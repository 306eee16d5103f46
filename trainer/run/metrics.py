"""Metrics sinks: one JSONL row per step (the source of truth, always), TensorBoard and W&B as report_to says."""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Written by rank 0 only. On resume, rows after the restored step are dropped so that
    the file never holds a step twice (the steps after the last checkpoint are re-run)."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None, reporters=("tensorboard",),
                 run_config: dict | None = None, wandb_project: str = "grpo", run_name: str | None = None):
        """reporters: where rows go besides metrics.jsonl (GRPOConfig.reporters(): tensorboard, wandb)."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        rows = read_metrics(self.path)
        keep_until = resume_step if resume_step is not None else -1
        kept = [r for r in rows if "step" in r and r["step"] <= keep_until]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._fh = self.path.open("a")
        self.tb = None
        if "tensorboard" in reporters:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: TensorBoard drops the earlier attempt's events from the restored step on, so the
            # steps re-run after a resume are shown once (their JSONL rows were dropped above for the same reason)
            self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"),
                                    purge_step=resume_step + 1 if resume_step is not None else None)
        self.wandb = None
        if "wandb" in reporters:
            try:
                import wandb
            except ImportError as e:  # asked for explicitly: say how to get it
                raise RuntimeError("report_to wandb: the wandb package is not installed (pip install wandb)") from e
            self.wandb = wandb.init(project=wandb_project, name=run_name or self.dir.name, dir=str(self.dir),
                                    config=run_config or {})

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **metrics}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        for k, v in metrics.items():
            if self.tb is not None and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        """A table of this step (sample completions) where a sink shows tables: W&B."""
        if self.wandb is not None:
            import wandb
            self.wandb.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
