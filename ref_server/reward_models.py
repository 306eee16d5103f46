"""Reward models held by the ref server (TRL 1.16's model entries of reward_funcs), scoring batches for every
producer: ranks, HF and vLLM workers and eval post `POST /reward` (app.py) instead of loading the model themselves.

    models = RewardModels.load([{"path": ..., "name": "tiny-rm", "tokenizer": None}], device, dtype, options)
    models.score("tiny-rm", prompts, completions)   # -> one float per completion

As TRL scores them (grpo_trainer.py, _calculate_rewards): loaded with AutoModelForSequenceClassification,
num_labels=1; the tokenizer is reward_processing_classes' entry or the model's own, pad = eos when it has none, and
the model's pad_token_id set to it (the score is read at the last non-pad token). A conversational prompt (a message
list) is rendered by TRL's own `apply_chat_template({"messages": prompt + completion}, tokenizer,
**chat_template_kwargs)` (the reward tokenizer's chat template, tokenize=False, no generation prompt; the run's
chat_template_kwargs come with the request); a text prompt is prompt + completion. The producer sends each prompt
as the policy saw it (trainer/rewards/models.py: a `chat` run's text prompt as its system + user messages). Right
padding, no special tokens added, no truncation; the reward is logits[:, 0]. Unlike TRL, rows are sorted by length
and scored in forwards of at most `token_budget` padded tokens (on CPU also at most 10 % of them padding; a row's
score does not depend on its neighbours: right padding, attention mask), in the ref server's dtype (bf16 on CUDA:
docs/trl.md).
"""
from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger("ref_server")


class RewardModelError(RuntimeError):
    """A reward model failed to load or to score: the message names it."""


class RewardModels:
    def __init__(self, models: dict, token_budget: int = 16384) -> None:
        self.models = models  # name -> (model, tokenizer)
        self.token_budget = token_budget
        self.lock = threading.Lock()  # one forward at a time (the HTTP threads share the device)
        self.rows = self.forwards = 0

    @classmethod
    def load(cls, entries: list[dict], device: torch.device, dtype: torch.dtype, options: dict | None = None,
             token_budget: int = 16384) -> RewardModels:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from common.modeling import tokenizer_options

        models = {}
        for e in entries:
            name, path = e["name"], e["path"]
            t0 = time.time()
            try:
                model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                                           **(options or {}))
                tok = AutoTokenizer.from_pretrained(e.get("tokenizer") or path, **tokenizer_options(options))
            except Exception as err:  # noqa: BLE001 - whatever loading raises (safetensors' own errors too): one line
                raise RewardModelError(f"reward model {name!r} ({path}) failed to load: {type(err).__name__}: "
                                       f"{' '.join(str(err).split())[:300]}") from err
            if model.config.num_labels != 1:
                raise RewardModelError(f"reward model {name!r} ({path}) has {model.config.num_labels} labels, "
                                       f"a reward model needs num_labels=1")
            if tok.pad_token_id is None:  # TRL: pad = eos
                tok.pad_token = tok.eos_token
            model.config.get_text_config().pad_token_id = tok.pad_token_id  # the score is read before the padding
            model.to(device).eval().requires_grad_(False)
            models[name] = (model, tok)
            log.info("reward model %s loaded from %s in %.1f s (%.1fM params, %s on %s)", name, path,
                     time.time() - t0, sum(p.numel() for p in model.parameters()) / 1e6,
                     str(dtype).replace("torch.", ""), device)
        return cls(models, token_budget)

    def names(self) -> list[str]:
        return list(self.models)

    @staticmethod
    def render(tok, prompt, completion, template_kwargs: dict | None = None) -> str:
        """The text TRL scores: the chat template over prompt + completion messages (TRL's apply_chat_template, imported
        here, lazily: ~1 s once, through common/trl_import.py like every TRL import), or prompt + completion."""
        if isinstance(prompt, list):
            from common.trl_import import trl_module

            turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            return trl_module("data_utils").apply_chat_template({"messages": list(prompt) + list(turns)}, tok,
                                                                **(template_kwargs or {}))["text"]
        return str(prompt) + (completion if isinstance(completion, str) else "".join(
            str(t.get("content") or "") for t in completion))

    def score(self, name: str, prompts: list, completions: list, template_kwargs: dict | None = None) -> list[float]:
        model, tok = self.models[name]
        texts = [self.render(tok, p, c, template_kwargs) for p, c in zip(prompts, completions, strict=True)]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        order = sorted(range(len(ids)), key=lambda k: len(ids[k]))
        out = [0.0] * len(ids)
        device = next(model.parameters()).device
        # CPU forwards are compute-bound: a padded token costs what a real one does, so a forward stops growing at
        # 10 % padding; on a GPU more rows per forward are nearly free, the token budget alone bounds them
        cap = 1.1 if device.type == "cpu" else float("inf")
        start = 0
        with self.lock, torch.inference_mode():
            while start < len(order):  # rows by length, as many as fit the budget when padded to the longest
                end, real = start + 1, len(ids[order[start]])
                while end < len(order):
                    width, real_next = len(ids[order[end]]), real + len(ids[order[end]])
                    if width * (end + 1 - start) > self.token_budget or width * (end + 1 - start) > cap * real_next:
                        break
                    end, real = end + 1, real_next
                rows = [ids[k] for k in order[start:end]]
                width = max(len(r) for r in rows)
                x = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, r in enumerate(rows):  # right padding
                    x[j, :len(r)] = torch.tensor(r, dtype=torch.long)
                    mask[j, :len(r)] = 1
                logits = model(input_ids=x.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu()
                for j, k in enumerate(order[start:end]):
                    out[k] = float(logits[j])
                self.forwards += 1
                start = end
            self.rows += len(ids)
        return out


def parse_request(raw: bytes, names: list[str]) -> tuple[str, list, list, dict]:
    """POST /reward's JSON body {"model": name, "prompts": [...], "completions": [...], "chat_template_kwargs": {}
    (optional)} -> its parts; ValueError (a 400) for anything else."""
    import json

    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("body must be JSON") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    name, prompts, completions = body.get("model"), body.get("prompts"), body.get("completions")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object")
    if name not in names:
        raise ValueError(f"no reward model {name!r} here (this server holds: {', '.join(names) or 'none'})")
    if not isinstance(prompts, list) or not isinstance(completions, list) or len(prompts) != len(completions):
        raise ValueError("prompts and completions must be lists of the same length")
    for p, c in zip(prompts, completions):
        if not isinstance(p, (str, list)) or not isinstance(c, (str, list)):
            raise ValueError("each prompt and completion must be a string or a list of messages")
        if isinstance(p, list) and not all(isinstance(m, dict) for m in p):
            raise ValueError("a conversational prompt must be a list of message objects")
    return name, prompts, completions, kwargs


def add_routes(app, models: RewardModels, require_token, error, to_json, max_body_bytes: int) -> None:
    """POST /reward on `app`: the token and the body limit as for /upload (ref_server/gate.py applies both at
    the header too); a model that fails to score answers 500 naming it (the producer stops the run)."""
    import bottle

    @app.post("/reward")
    def reward():
        require_token()
        length = int(bottle.request.environ.get("CONTENT_LENGTH") or 0)
        if length > max_body_bytes:
            raise error(413, f"body of {length} bytes exceeds the limit of {max_body_bytes} bytes")
        try:
            name, prompts, completions, kwargs = parse_request(bottle.request.body.read(max_body_bytes + 1),
                                                               models.names())
        except ValueError as e:
            raise error(400, f"invalid reward request: {e}") from None
        t0 = time.time()
        try:
            rewards = models.score(name, prompts, completions, kwargs)
        except Exception as e:  # noqa: BLE001 - a model (or its chat template) failing: said, naming it
            log.error("reward model %s failed: %s: %s", name, type(e).__name__, e)
            raise error(500, f"reward model {name!r} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                        ) from None
        log.debug("reward model %s scored %d completions in %.3f s", name, len(rewards), time.time() - t0)
        return to_json({"model": name, "rewards": rewards})
