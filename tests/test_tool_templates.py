"""Tool-call parsing and the chat template of a tool run as TRL 1.16 sets them up (issues 39, 60), with TRL's own
helpers (trl.chat_template_utils: add_response_schema, supports_tool_calling, is_chat_template_prefix_preserving,
get_training_chat_template). Per template TRL knows: the run's template renders a call in its family's format, and
ToolBox (given only the tokenizer) parses it back; Qwen3's and gpt-oss's templates are swapped for TRL's training
templates; Llama 3.1/3.2 (no training template) and DeepSeek-R1-distill (cannot write a call) are refused at start.
A template of no known family is refused, in one line naming the model, by the ToolBox and by `launch.sh check`
(trainer.check in a folder outside the checkout)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import find_free_port

from common.trl_import import trl_module
from trainer.tools import ToolBox
from trainer.tools.schemas import load_tools
from trainer.tools.templates import OWN, tool_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]
# TRL 1.16's chat templates that add_response_schema knows -> (family, training template swapped in a tool run)
FAMILIES = {
    "qwen2_5": "qwen3", "qwen3": "qwen3", "qwen3_instruct_2507": "qwen3", "qwen3_vl": "qwen3",
    "qwen3_5_nothink": "qwen3_5", "qwen3_5_think": "qwen3_5", "qwen3_6": "qwen3_5", "qwen3_8": "qwen3_5",
    "nemotron_3_nano": "nemotron_3", "nemotron_3_super": "nemotron_3", "nemotron_3_ultra": "nemotron_3",
    "nemotron_3_5_lightning": "nemotron_3", "lfm2_v2": "lfm2_2_5", "lfm2_2_5": "lfm2_2_5", "lfm2_2_5_v2": "lfm2_2_5",
    "lfm2_2_5_vl": "lfm2_2_5", "gemma4": "gemma4", "gemma4_v2": "gemma4", "gemma4_v3": "gemma4",
    "gemma4_v4": "gemma4", "gemma4_v5": "gemma4", "glm4moe": "glm4moe", "gptoss": "gptoss",
    "llama3_1": "llama3", "llama3_2": "llama3", "deepseek_r1_distill": "deepseek_r1_distill"}
# TRL decides on token ids (is_chat_template_prefix_preserving): with this character-level vocabulary only Qwen3's
# text changes; gpt-oss's swap and Llama 3.1/3.2's refusal, on the real Qwen vocabulary: tests/test_tool_trl_render.py
SWAPPED = {"qwen3": "qwen3_training"}
REFUSED = {"deepseek_r1_distill": "cannot render a tool-calling conversation"}


def trl_template(name: str) -> str:
    return getattr(trl_module("chat_template_utils"), f"{name}_chat_template")


@pytest.fixture(scope="module")
def tiny_tok():
    from common.modeling import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path("tiny"))


def with_template(tok, text: str):
    tok = copy.deepcopy(tok)
    tok.chat_template, tok.response_template = text, None
    return tok


def box_for(tok) -> ToolBox:
    box = ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="m")
    box.schemas.append(WEATHER)
    return box


def rendered_call(tok, kw: dict) -> tuple[str, str]:
    """(the prompt the model continues, the assistant turn with the call) as the run's template writes them (TRL's
    training template where it swaps one in): the turn is what follows the generation prompt."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prefix = tok.apply_chat_template(user, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kw)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": CALL}], tools=[WEATHER],
                                   tokenize=False, **kw)
    if prefix.endswith("<think>\n") and "<think></think>" in full:  # Nemotron 3 prefills the <think> opener
        return prefix, "Checking.</think>" + full.split("<think></think>", 1)[1]
    assert full.startswith(prefix)
    return prefix, full[len(prefix):]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_known_template_parses_its_own_calls(tiny_tok, name):
    tok = with_template(tiny_tok, trl_template(name))
    if name in REFUSED:  # as GRPOTrainer refuses them with tools, at the start, in one line naming the model
        with pytest.raises(ValueError, match=f"model m: .*{REFUSED[name]}") as e:
            box_for(tok)
        assert "\n" not in str(e.value)
        return
    box = box_for(tok)
    assert box.family == FAMILIES[name] and box.template.training_template == SWAPPED.get(name)
    assert tok.chat_template == trl_template(name)  # the tokenizer keeps the model's own (a checkpoint saves it)
    prefix, turn = rendered_call(tok, box.template_kwargs)
    calls, bad = box.parse(turn, prefix)
    assert bad == [] and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_the_tiny_models_template_and_a_tokenizers_own_response_template(tiny_tok):
    assert box_for(copy.deepcopy(tiny_tok)).family == "qwen3"  # Qwen2.5's call format (TRL refuses this template)
    own = with_template(tiny_tok, trl_template("qwen2_5"))
    own.response_template = {**trl_module("chat_template_utils").qwen3_template, "defaults": {"role": "bot"}}
    assert tool_template(own, "m").family == OWN  # kept as TRL keeps it (no add_response_schema)


def test_a_template_of_no_known_family_is_refused_in_one_line(tiny_tok):
    tok = with_template(tiny_tok, trl_template("qwen2_5") + " ")  # not TRL's exactly
    with pytest.raises(ValueError, match="model my/model: its chat template is none of") as e:
        ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="my/model")
    assert "\n" not in str(e.value)
    assert ToolBox(load_tools([], None), tokenizer=tok).family is None  # no tools: nothing to parse, no refusal


@pytest.mark.parametrize("template, line", [
    ("odd", "FAIL tools .*: its chat template is none of"),
    ("llama3_1", "FAIL tools .*: its chat template \\(llama3\\) renders an assistant turn differently .* no training "
                 "chat template"),
    ("qwen3", "ok   tools    1 tools, all shown by the chat template; calls parsed as qwen3; chat template TRL's "
              "qwen3_training \\(the model's own does not keep")])
def test_check_says_the_family_and_training_template_or_refuses(request, tmp_path, check_in, template, line):
    """Through trainer.check in the user's folder (what `launch.sh check` execs, GRPO_USER_DIR set as launch.sh
    sets it): the check's own line is the subject, a launch.sh start would add a torch import and nothing else.
    A model with another template: one TRL knows no family of (the tiny model's, changed), Llama 3.1's on the real
    Qwen vocabulary (refused: not prefix-preserving there, and TRL has no training template for it), Qwen3's on the
    tiny model (swapped for TRL's training template, said in the tools line)."""
    import re

    from conftest import qwen_vocab_dir

    from common.modeling import resolve_model_path
    model = tmp_path / "model"
    source = Path(qwen_vocab_dir(request, "instruct") if template == "llama3_1" else resolve_model_path("tiny"))
    model.mkdir()
    for f in source.iterdir():  # the weights are not read by the check: linked, the template replaced
        (model / f.name).symlink_to(f)
    own = (source / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").write_text(own + "{# changed #}" if template == "odd" else trl_template(template))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "2+2", "ground_truth": "4"}) + "\n")
    args = ["--model", str(model), "--data", "train.jsonl", "--tools", "calculator", "--max_new_tokens", "8",
            "--max_prompt_length", "2048"]
    code, out, _ = check_in(tmp_path, "--port", str(find_free_port()), "--", *args)
    fails = [x for x in out.splitlines() if x.startswith("FAIL")]
    assert [x for x in out.splitlines() if re.match(line, x)], out
    assert (code, len(fails)) == ((0, 0) if template == "qwen3" else (1, 1)), out
