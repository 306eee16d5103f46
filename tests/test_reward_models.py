"""Reward models (issue 44): which reward_fns entries are models, their config.json checked without weights, and
the ref server's scoring (ref_server/reward_models.py, POST /reward) equal to TRL 1.16's: the reward tokenizer's
chat template over prompt + completion messages (or prompt text + completion), right padding, no special tokens,
logits[:, 0], here computed one completion at a time with transformers in fp32."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import start_ref_server, subprocess_env

from common.config import GRPOConfig
from common.settings.knobs import load_config
from common.settings.reward_models import config_refusal, reward_model_name, reward_model_path

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
COMPLETIONS = ["<answer>5</answer>", "Blue, I think; or maybe a much longer answer about green and red."]


def build_rm(folder, labels: int = 1, arch: str = "Qwen2ForSequenceClassification"):
    """A tiny random-weight reward model from the embedded tiny Qwen2's config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    from common.modeling import resolve_model_path
    src = resolve_model_path("tiny")
    c = AutoConfig.from_pretrained(src)
    c.num_labels = labels
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(c).save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    if arch != "Qwen2ForSequenceClassification":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch])))
    return folder


FLAG_TEMPLATE = "{%- if thinking is defined and not thinking %}NO-THINK {% endif %}"  # reacts to a template kwarg


def trl_score(folder, prompt, completion, **template_kwargs) -> float:
    """TRL 1.16's reward-model score of one completion (fp32 on CPU, transformers only)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    if isinstance(prompt, list):
        text = tok.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False,
                                       **template_kwargs)
    else:
        text = prompt + completion
    x = tok(text=[text], return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return float(model(**x).logits[:, 0])


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """Its chat template says NO-THINK first under chat_template_kwargs {"thinking": false} (Qwen3's pattern)."""
    from transformers import AutoTokenizer

    folder = build_rm(tmp_path_factory.mktemp("rm") / "tiny-rm")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = FLAG_TEMPLATE + tok.chat_template
    tok.save_pretrained(folder)
    return folder


def test_which_entries_are_models(rm, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_USER_DIR", str(rm.parent))
    assert reward_model_path("tiny-rm") == str(rm.resolve())  # relative: from the user's folder
    assert reward_model_path(str(rm)) == str(rm.resolve())
    assert reward_model_path("OpenAssistant/reward-model-deberta") == "OpenAssistant/reward-model-deberta"
    for fn in ("format", "my_rewards:score", "path/to/r.py:f", "trainer/rewards", "os/path"):
        assert reward_model_path(fn) is None, fn  # functions, an importable module, a folder with no config.json
    assert reward_model_name("./models/tiny-rm/") == "tiny-rm" and reward_model_name("org/rm-7b") == "rm-7b"
    cfg = load_config(GRPOConfig, ["--reward_fns", json.dumps(["tiny-rm", "format"]),
                                   "--reward_processing_classes", json.dumps([str(rm), None])])
    assert [(m["index"], m["name"], m["tokenizer"]) for m in cfg.reward_models()] == [(0, "tiny-rm", str(rm))]
    flag, value = cfg.reward_model_server_args()
    assert flag == "--reward_models" and json.loads(value) == [{"path": str(rm.resolve()), "name": "tiny-rm",
                                                                 "tokenizer": str(rm)}]


def test_bad_models_and_tokenizer_lists_refused_in_one_line(rm, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    two = build_rm(tmp_path / "two-labels", labels=2)
    lm = build_rm(tmp_path / "lm", arch="Qwen2ForCausalLM")
    assert "has 2 labels" in config_refusal(str(two), "two-labels")
    assert "Qwen2ForCausalLM" in config_refusal(str(lm), "lm") and config_refusal(str(rm), "tiny-rm") is None
    with pytest.raises(ValueError, match="reward model 'lm'.*ForSequenceClassification"):
        load_config(GRPOConfig, ["--reward_fns", "lm,format"])
    with pytest.raises(ValueError, match="reward_processing_classes must be a list with one entry"):
        load_config(GRPOConfig, ["--reward_fns", "format", "--reward_processing_classes", "[null, null]"])
    with pytest.raises(ValueError, match="tokenizer for an entry that is a reward function"):
        load_config(GRPOConfig, ["--reward_fns", "format", "--reward_processing_classes", "[\"x\"]"])


def test_server_scores_as_trl(rm):
    from ref_server.reward_models import RewardModels

    models = RewardModels.load([{"path": str(rm), "name": "tiny-rm", "tokenizer": None}], torch.device("cpu"),
                               torch.float32, token_budget=64)  # a small budget: several forwards, sorted rows
    got = models.score("tiny-rm", PROMPTS, COMPLETIONS)
    want = [trl_score(rm, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(want, abs=1e-4) and models.forwards == 2
    text = models.score("tiny-rm", ["2 + 3 = ", "Colour: "], COMPLETIONS)
    assert text == pytest.approx([trl_score(rm, p, c) for p, c in zip(["2 + 3 = ", "Colour: "], COMPLETIONS)],
                                 abs=1e-4)
    assert got[0] != got[1]
    flagged = models.score("tiny-rm", PROMPTS, COMPLETIONS, {"thinking": False})  # the run's chat_template_kwargs
    assert flagged == pytest.approx([trl_score(rm, p, c, thinking=False) for p, c in zip(PROMPTS, COMPLETIONS)],
                                    abs=1e-4) and flagged != pytest.approx(got, abs=1e-4)


def test_a_prompt_goes_to_the_reward_model_as_the_policy_saw_it():
    """TRL scores the prompt the policy was given: under our `chat` format (the default for text prompts) that is
    the system + user turns through a chat template, so the reward model gets those messages, not the bare text."""
    from common.prompts import SYSTEM_PROMPT
    from trainer.data.prompt_formats import R1ZERO_TEMPLATE, prompt_as_seen

    q, conv = "What is 2 + 3?", PROMPTS[0]
    assert prompt_as_seen(q, "default", "auto") == [{"role": "system", "content": SYSTEM_PROMPT},
                                                    {"role": "user", "content": q}]
    assert prompt_as_seen(q, "Be brief.", "chat")[0] == {"role": "system", "content": "Be brief."}
    assert prompt_as_seen(q, "none", "chat") == [{"role": "user", "content": q}]
    assert prompt_as_seen(conv, "default", "auto") == conv  # messages: no system prompt added by default
    assert prompt_as_seen(conv, "Be brief.", "messages") == [{"role": "system", "content": "Be brief."}, *conv]
    assert prompt_as_seen(q, "default", "trl") == q and prompt_as_seen(conv, "default", "trl") == conv  # TRL's own
    assert prompt_as_seen(q, "", "r1zero") == R1ZERO_TEMPLATE.format(prompt="What is 2 + 3?")


def test_reward_route_authenticated_and_named_failures(rm, tiny_model_dir):
    """A real ref server process (--reward_models): POST /reward as TRL scores, behind the token and the body limit."""
    from common.wire.client import RefClient, RefServerError

    env = subprocess_env(GRPO_REF_TOKEN="s3cret")
    models = json.dumps([{"path": str(rm), "name": "tiny-rm", "tokenizer": None}])
    with start_ref_server(tiny_model_dir, "--max_body_mb", "0.01", "--reward_models", models, env=env) as srv:
        assert "reward model tiny-rm loaded from" in srv.log()
        client = RefClient(srv.url, token="s3cret", timeout=30)
        got = client.reward_scores("tiny-rm", PROMPTS, COMPLETIONS, timeout=30)
        assert got == pytest.approx([trl_score(rm, p, c) for p, c in zip(PROMPTS, COMPLETIONS)], abs=1e-4)
        # a producer's reward model function: a text prompt of a `chat` run as the policy saw it, with the run's
        # chat_template_kwargs (today: "2 + 3 = " + completion as plain text, no kwargs)
        from common.prompts import SYSTEM_PROMPT
        from trainer.rewards.models import RewardModelFn
        fn = RewardModelFn("tiny-rm", client, 30, "default", "auto", {"thinking": False})
        seen = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "2 + 3 = "}]
        assert fn(prompts=["2 + 3 = "], completions=COMPLETIONS[:1]) == pytest.approx(
            [trl_score(rm, seen, COMPLETIONS[0], thinking=False)], abs=1e-4)
        with pytest.raises(RefServerError, match="401"):
            RefClient(srv.url, token="wrong", timeout=5).reward_scores("tiny-rm", PROMPTS, COMPLETIONS, timeout=5)
        with pytest.raises(RefServerError, match="no reward model 'other'"):
            client.reward_scores("other", PROMPTS, COMPLETIONS, timeout=5)
        with pytest.raises(RefServerError, match="413"):  # the same body limit as the rollouts' uploads
            client.reward_scores("tiny-rm", ["x" * 20000], ["y"], timeout=5)
        with pytest.raises(RefServerError, match="reward model 'tiny-rm' failed"):  # a template that cannot render
            client.reward_scores("tiny-rm", [[{"content": "no role"}]], [[{"role": 3}]], timeout=5)


def test_scorer_routes_models_through_the_reward_path(rm):
    """A reward model is one more reward of the group: weighted, named, and a failure names it."""
    from trainer.data.example import Example
    from trainer.rewards.scoring import RewardScorer

    calls = []

    def fake(prompts, completions, **_):
        calls.append((prompts, completions))
        return [2.0] * len(completions)

    scorer = RewardScorer(["tiny-rm", "format"], [0.5, 1.0], timeout=0, conversational=True, models={0: fake})
    ex = Example(prompt=PROMPTS[0], ground_truth="5")
    score = scorer.score_group(ex, COMPLETIONS)
    assert scorer.names == ["fake", "format"]
    assert calls[0] == ([PROMPTS[0]] * 2, [[{"role": "assistant", "content": c}] for c in COMPLETIONS])
    assert score.rewards[0] == pytest.approx(0.5 * 2.0 + score.components["format"][0])


def test_print_plan_counts_the_reward_model_on_the_ref_servers_gpu(tmp_path):
    """`launch.sh train --print-plan` (fake nvidia-smi, 8 x 80 GB): a Qwen2.5-7B-shaped reward model adds its bf16
    weights (7.07 B parameters: no LM head) to the ref server's line, and launch.sh hands the server --reward_models."""
    from test_memory_plan import QWEN7B, print_plan

    rm = tmp_path / "rm7b"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps(dict(QWEN7B, architectures=["Qwen2ForSequenceClassification"],
                                                    id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})))
    base = print_plan(tmp_path, 8, 81559, "--workers", "1", "--", "--model", str(rm), "--reward_fns", "format")
    proc = print_plan(tmp_path, 8, 81559, "--workers", "1", "--", "--model", str(rm), "--reward_fns",
                      json.dumps(["rm7b", "format"]))
    assert base.returncode == 0 and proc.returncode == 0, proc.stderr
    h, L, inter, V, kv = 3584, 28, 18944, 152064, 4 * 128
    n = V * h + L * (h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h) + 2 * h
    ref = next(line for line in proc.stderr.splitlines() if "ref_server" in line and "weights" in line)
    assert f"reward_models {n * 2 / 2 ** 30:.1f}" in ref, ref
    assert "reward_models" not in base.stderr
