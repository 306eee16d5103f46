"""GRPOTrainer of the Python API: TRL's arguments, this system's run (docs/trl.md "A TRL script").

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_reward], args=GRPOConfig(...),
                          train_dataset=dataset)
    trainer.train()                # launch.sh train: ref server, workers, ranks; TrainOutput when it is done
    trainer.save_model("out")      # the run's final model, from_pretrained-loadable

Construction checks everything it can in this process (names, refusals, the config), so a bad argument fails here in
one line; train() writes the datasets and the config into the run directory once, then every process reads them.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trainer.api.inputs as inputs
import trainer.api.names as names
from trainer.api.config import GRPOConfig, resolve
from trainer.api.process import CHECKOUT, LAUNCH_ARGS_ENV, TrainingFailed, environment, run_launch, stream

CONFIG_FILE = "api_config.json"  # in the run directory: the config launch.sh train --config reads


@dataclass
class TrainerState:
    """What TRL's trainer.state holds that a script reads after train()."""
    global_step: int = 0
    max_steps: int = 0
    log_history: list = field(default_factory=list)


class GRPOTrainer:
    """TRL 1.16's GRPOTrainer arguments (and ours: agent, launch_args = launch.sh train options such as
    ["--workers", "2"], also from the GRPO_LAUNCH_ARGS environment variable)."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None, rollout_func: Any = None,
                 environment_factory: Any = None, agent: Any = None, launch_args: list[str] | None = None) -> None:
        inputs.refuse_unsupported({"callbacks": callbacks, "optimizers": tuple(optimizers or (None, None)),
                                   "quantization_config": quantization_config, "rollout_func": rollout_func})
        names.script_guarded()
        self.model_name = inputs.model_name(model)
        if args is None:  # as TRL: a folder named after the model
            args = GRPOConfig(output_dir=f"{self.model_name.split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise ValueError(f"GRPOTrainer: args is a {type(args).__name__}; pass trainer.api.GRPOConfig(...)")
        self.args = args
        given = args.to_dict()
        if train_dataset is None and not {"data", "dataset_name"} & set(given):
            raise ValueError("GRPOTrainer: train_dataset is needed (or data / dataset_name in GRPOConfig)")
        ours = {"model": self.model_name, **inputs.lora_fields(peft_config)}
        inputs.check_processing_class(processing_class, self.model_name)
        if reward_funcs is not None:
            ours["reward_fns"] = inputs.reward_specs(reward_funcs)
        if tools:
            ours["tools"] = inputs.tool_specs(tools)
        if environment_factory is not None:
            ours["environment_factory"] = inputs.environment_spec(environment_factory)
        if agent is not None:
            ours.update(_agent(agent))
        if reward_processing_classes is not None:
            toks = reward_processing_classes if isinstance(reward_processing_classes, list) \
                else [reward_processing_classes]
            ours["reward_processing_classes"] = [inputs.tokenizer_name(t, "reward_processing_classes") for t in toks]
        here = {*ours, "model_name_or_path", *(("data", "dataset_name") if train_dataset is not None else ()),
                *(("eval_data",) if eval_dataset is not None else ())}
        both = sorted(set(given) & here)
        if both:
            raise ValueError(f"GRPOTrainer: {', '.join(both)} given in GRPOConfig and as a GRPOTrainer argument; give "
                             f"it once")
        self.run_dir = Path(args.resolved.output_dir).expanduser().resolve()  # relative to where the script runs
        for data, where in ((train_dataset, "train_dataset"), (eval_dataset, "eval_dataset")):
            if data is not None:
                inputs.check_dataset(data, where)
        self._unwritten = {k: d for k, d in (("data", train_dataset), ("eval_data", eval_dataset)) if d is not None}
        self._values = {**given, **ours, "output_dir": str(self.run_dir)}
        if train_dataset is not None:  # the files' names, so that the whole config is checked here
            self._values["data"] = str(self.run_dir / "data" / "train.parquet")
        if eval_dataset is not None:
            self._values["eval_data"] = str(self.run_dir / "data" / "eval.parquet")
        self.config = resolve(self._values)
        self.launch_args = list(launch_args or []) + shlex.split(os.environ.get(LAUNCH_ARGS_ENV, ""))
        for opt in ("--run-dir", "--run_dir", "--config"):
            if opt in self.launch_args:
                raise ValueError(f"GRPOTrainer: launch_args {opt}: the run directory is args.output_dir and the "
                                 f"config is args; give them there")
        self.state = TrainerState(max_steps=self.config.all_steps)

    def _write_inputs(self) -> Path:
        """Each dataset written once (parquet) into the run directory, and the config as it stands."""
        for key, where in (("data", "train_dataset"), ("eval_data", "eval_dataset")):
            if key in self._unwritten:
                inputs.write_dataset(self._unwritten.pop(key), Path(self._values[key]), where)
        path = self.run_dir / CONFIG_FILE
        path.write_text(json.dumps(self._values, indent=1) + "\n")
        return path

    def train(self, resume_from_checkpoint: bool | None = None, trial: Any = None,
              ignore_keys_for_eval: Any = None):
        """Start the run (launch.sh train) and wait for it; TRL's TrainOutput(global_step, training_loss, metrics).
        resume_from_checkpoint True: continue from output_dir's newest checkpoint. TrainingFailed on a failure."""
        from common.listen import free_port_for_later
        if trial is not None or ignore_keys_for_eval is not None:
            raise ValueError("train: trial (hyperparameter search) and ignore_keys_for_eval are not supported: one "
                             "run per train(), evaluation reports all its metrics")
        if resume_from_checkpoint is not None:
            self._values["resume_from_checkpoint"] = resume_from_checkpoint
            self.config = resolve(self._values)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_inputs()
        launch = list(self.launch_args)
        if not {"--port", "--ref-url", "--ref_url"} & set(launch):  # two scripts on one machine must not collide
            launch += ["--port", str(free_port_for_later())]
        t0 = time.time()
        run_launch(["--config", str(config), "--run-dir", str(self.run_dir), *launch], self.run_dir,
                   names.script_dir())
        return self._train_output(time.time() - t0)

    def _train_output(self, seconds: float):
        from transformers.trainer_utils import TrainOutput

        from trainer.run.metrics import read_metrics
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        saved = self.run_dir / "config.json"  # the ranks' resolved config (num_train_epochs -> all_steps)
        steps = json.loads(saved.read_text())["all_steps"] if saved.is_file() else (rows[-1]["step"] if rows else 0)
        losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
        loss = sum(losses) / len(losses) if losses else 0.0
        metrics = {"train_runtime": round(seconds, 3), "train_steps_per_second": round(steps / max(seconds, 1e-9), 3),
                   "train_loss": loss}
        self.state.global_step, self.state.max_steps = steps, steps
        self.state.log_history = [*rows, {"step": steps, **metrics}]
        return TrainOutput(steps, loss, metrics)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The run's final model (from_pretrained-loadable, tokenizer included; a LoRA run's is merged) into
        output_dir (default: args.output_dir)."""
        final = self.run_dir / "final"
        if not (final / "config.json").is_file():
            raise ValueError(f"save_model: {final} holds no trained model; call train() first")
        dest = Path(output_dir or self.run_dir).expanduser().resolve()
        run_config = dest / "config.json"
        if dest == self.run_dir and run_config.is_file() and "all_steps" in json.loads(run_config.read_text()):
            run_config.rename(dest / "run_config.json")  # the model's config.json takes its name (as TRL's folder)
            print(f"[api] the run's config.json is now {dest / 'run_config.json'}", file=sys.stderr)
        shutil.copytree(final, dest, dirs_exist_ok=True)
        print(f"[api] model saved to {dest}", file=sys.stderr)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """The project's evaluation (python -m trainer.evaluate) of the trained model (before train(): the initial
        one) on eval_dataset, scored with the run's rewards; {eval_accuracy, eval_format_rate, eval_reward/<fn>...}."""
        if eval_dataset is not None:
            self._unwritten["eval_data"] = eval_dataset
            self._values["eval_data"] = str(self.run_dir / "data" / "eval.parquet")
        if "eval_data" not in self._values:
            raise ValueError("evaluate: needs an eval_dataset (GRPOTrainer(eval_dataset=...) or evaluate(ds))")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_inputs()
        final = self.run_dir / "final"
        model = str(final) if (final / "config.json").is_file() else self.model_name
        out = self.run_dir / f"{metric_key_prefix}.json"
        data = self._values["eval_data"]  # a path of the user's is theirs: it runs in the checkout
        data = str(Path(data).resolve()) if Path(data).exists() else data
        split = [] if Path(data).is_file() else ["--split", self.config.eval_split]  # a hub id or folder: its split
        cmd = [sys.executable, "-m", "trainer.evaluate", "--model", model, "--data", data, *split,
               "--config", str(config), "--out", str(out), *_eval_flags(self.config)]
        code, tail = stream(cmd, environment(names.script_dir()), cwd=CHECKOUT)
        if code != 0:
            last = next((x.strip() for x in reversed(tail) if x.strip()), "no output")
            raise TrainingFailed(f"evaluation failed (exit code {code}): {last}", code, self.run_dir)
        res = json.loads(out.read_text())
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in res.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
        self.state.log_history.append({"step": self.state.global_step, **metrics})
        return metrics


def _eval_flags(c) -> list[str]:
    """trainer.evaluate's flags from the run's config (how prompts are made and completions scored)."""
    flags = ["--limit", str(c.eval_limit), "--max-new-tokens", str(c.max_new_tokens),
             "--system-prompt", c.system_prompt or "", "--prompt-format", c.prompt_format,
             "--trust-remote-code", str(c.trust_remote_code).lower()]
    for flag, value in (("--prompt-column", c.prompt_column), ("--answer-column", c.answer_column),
                        ("--prompt-template", c.prompt_template), ("--attn-implementation", c.attn_implementation),
                        ("--revision", c.revision), ("--max-tool-calling-iterations", c.max_tool_calling_iterations)):
        if value is not None:
            flags += [flag, str(value)]
    if c.chat_template_kwargs:
        flags += ["--chat-template-kwargs", json.dumps(c.chat_template_kwargs)]
    if c.tools:
        flags += ["--tools", ",".join(c.tools)]
    if isinstance(c.environment_factory, str):
        flags += ["--environment-factory", c.environment_factory]
    return flags


def _agent(agent: Any) -> dict:
    """This project's agent rollouts, where the checkout has them (a GRPOConfig field `agent`)."""
    from common.config import GRPOConfig as Ours
    if "agent" not in Ours.__dataclass_fields__:
        raise ValueError("GRPOTrainer: agent: this checkout has no agent rollouts (GRPOConfig has no `agent` field)")
    return {"agent": agent if isinstance(agent, str) else names.spec_of(agent, "agent", "agent")}
