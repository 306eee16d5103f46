"""Tool-call parsing as TRL 1.16 (issue 39): the tokenizer's chat template is matched against the templates TRL
knows (kept as data in trainer/tools/chat_templates/), the family's response template is set, and transformers'
parse_response reads the calls. Per template: the real chat template renders a call in its family's format, and
ToolBox (given only the tokenizer) parses it back. A template of no known family is refused, in one line naming the
model, by the ToolBox and by `launch.sh check` (from a folder outside the checkout, no PYTHONPATH)."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
from conftest import find_free_port

from trainer.tools import ToolBox
from trainer.tools.schemas import load_tools
from trainer.tools.templates import DATA, families, response_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]
TEMPLATES = [(fam, name) for fam, spec in families().items() for name in spec["chat_templates"]]


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


def rendered_call(tok) -> tuple[str, str]:
    """(the prompt the model continues, the assistant turn with the call) as the family's real template writes
    them: the turn is what follows the generation prompt in the rendered conversation."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prefix = tok.apply_chat_template(user, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": CALL}], tools=[WEATHER],
                                   tokenize=False)
    if prefix.endswith("<think>\n") and "<think></think>" in full:  # Nemotron 3 prefills the <think> opener
        return prefix, "Checking.</think>" + full.split("<think></think>", 1)[1]
    assert full.startswith(prefix)
    return prefix, full[len(prefix):]


@pytest.mark.parametrize("family, name", TEMPLATES, ids=[n for _, n in TEMPLATES])
def test_each_known_template_parses_its_own_calls(tiny_tok, family, name):
    tok = with_template(tiny_tok, (DATA / f"{name}.jinja").read_text(encoding="utf-8"))
    if "tool_calls" not in families()[family]["response_template"]["fields"]:  # DeepSeek-R1-distill: TRL parses
        with pytest.raises(ValueError, match="parses no tool calls"):  # no calls (its template cannot write one)
            box_for(tok)
        return
    box = box_for(tok)
    assert box.family == family
    prefix, turn = rendered_call(tok)
    calls, bad = box.parse(turn, prefix)
    assert bad == [] and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_the_tiny_models_template_and_a_tokenizers_own_response_template(tiny_tok):
    assert box_for(copy.deepcopy(tiny_tok)).family == "qwen3"  # Qwen2.5's call format
    own = with_template(tiny_tok, "{{ messages }}")
    own.response_template = families()["llama3"]["response_template"]
    assert response_template(own, "m")[0] == "the tokenizer's own response_template"


def test_a_template_of_no_known_family_is_refused_in_one_line(tiny_tok):
    tok = with_template(tiny_tok, (DATA / "qwen2_5.jinja").read_text(encoding="utf-8") + " ")  # not TRL's exactly
    with pytest.raises(ValueError, match="model my/model: its chat template is none of") as e:
        ToolBox(load_tools(["calculator"], None), tokenizer=tok, model="my/model")
    assert "\n" not in str(e.value)
    assert ToolBox(load_tools([], None), tokenizer=tok).family is None  # no tools: nothing to parse, no refusal


def test_check_refuses_a_tool_config_whose_template_cannot_be_parsed(tmp_path, check_in):
    """Through trainer.check in the user's folder (what `launch.sh check` execs, GRPO_USER_DIR set as launch.sh
    sets it): the check's own line is the subject, a launch.sh start would add a torch import and nothing else."""
    from common.modeling import resolve_model_path
    model = tmp_path / "odd_model"
    shutil.copytree(resolve_model_path("tiny"), model)
    (model / "chat_template.jinja").write_text((model / "chat_template.jinja").read_text() + "{# changed #}")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "2+2", "ground_truth": "4"}) + "\n")
    args = ["--model", str(model), "--data", "train.jsonl", "--tools", "calculator", "--max_new_tokens", "8"]
    code, out, _ = check_in(tmp_path, "--port", str(find_free_port()), "--", *args)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code != 0 and len(fails) == 1, out
    assert fails[0].startswith("FAIL tools") and f"model {model}: its chat template is none of" in fails[0], fails
