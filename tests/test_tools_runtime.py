"""The tool runtime's parts that need no executor process (issue 32): parsing one turn's calls, tool schemas from
a user folder (file.py:fn, module:fn, an environment class), the calculator and its refusals, the config fields,
and `launch.sh check`'s tool lines."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.config import GRPOConfig
from common.knobs import from_dict, load_config
from trainer.tools import ToolBox, ToolCall, ToolResult
from trainer.tools.calculator import CalculatorError, calculator
from trainer.tools.schemas import load_tools

HERE = Path(__file__).resolve().parent
USER_MODULE = "tools_user_rt"  # a name no other test module uses (sys.modules caches it per process)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    shutil.copy(HERE / "tools_user_code.py", folder / f"{USER_MODULE}.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_USER_DIR", str(folder))
        yield folder


def calc_box() -> ToolBox:
    return ToolBox(load_tools(["calculator"], None))


# ---------------------------------------------------------------- parsing
def test_parse_one_well_formed_call():
    calls, bad = calc_box().parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
                                  '{"expression": "12 * 34"}}\n</tool_call>')
    assert calls == [ToolCall("calculator", {"expression": "12 * 34"})] and bad == []


def test_parse_several_calls_in_one_turn_in_order():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> and '
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>\n'
            '<tool_call>{"name": "noargs"}</tool_call>')
    calls, bad = calc_box().parse(text)
    assert [c.name for c in calls] == ["calculator", "python", "noargs"] and bad == []
    assert calls[2].arguments == {}  # no "arguments": a call without any (TRL normalises to {})


def test_no_call_is_no_call():
    assert calc_box().parse("The answer is 42.") == ([], [])


@pytest.mark.parametrize("body, says", [
    ('{"name": "calculator", "arguments": {"expression": "1+1",}}', "not valid JSON"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "calculator", "arguments": "1+1"}', "must be a JSON object"),
    ('["calculator"]', "not a JSON object"),
])
def test_malformed_calls_are_results_in_one_line(body, says):
    box = calc_box()
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    calls, bad = box.parse(f"{good}<tool_call>{body}</tool_call>")
    assert [c.name for c in calls] == ["calculator"]  # the good call next to it still runs
    assert len(bad) == 1 and bad[0].status == "malformed" and bad[0].name == ""
    assert says in bad[0].content and "\n" not in bad[0].content
    assert box.stats()["malformed"] == 1 and box.stats()["failed"] == 1


def test_an_unclosed_call_is_malformed():
    calls, bad = calc_box().parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}')
    assert calls == [] and "not closed" in bad[0].content


def test_a_tokenizer_with_a_response_template_parses_with_transformers(tiny_tokenizer):
    """transformers' own parse_response, not ours: it casts the arguments to the schema's types ("4" -> 4)."""
    tok = tiny_tokenizer
    tok.response_template = {  # the Qwen shape, in transformers' response-template language
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                  "content": "json", "transform": {"type": "function", "function": "{content}"}},
                   "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    try:
        box = ToolBox(load_tools(["calculator"], None), tokenizer=tok)
        box.schemas.append({"type": "function", "function": {"name": "mul", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}})
        calls, bad = box.parse('<tool_call>{"name": "mul", "arguments": {"a": 3, "b": "4"}}</tool_call>'
                               '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
                               '<|im_end|>')
        assert [(c.name, c.arguments) for c in calls] == [("mul", {"a": 3, "b": 4}), ("calculator",
                                                                                      {"expression": "1"})]
        calls, bad = box.parse('<tool_call>{"name": "mul", "arguments": {"a": 3,}}</tool_call><|im_end|>')
        assert calls == [] and bad[0].status == "malformed" and "\n" not in bad[0].content
    finally:
        tok.response_template = None


@pytest.fixture
def tiny_tokenizer():
    from common.modeling import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path("tiny"))


def test_an_unknown_tool_names_the_tools_that_exist():
    box = calc_box()
    [ep] = box.start_episodes(1)
    [[r]] = box.run([(ep, [ToolCall("calculater", {"expression": "1"})])])
    assert r.status == "unknown_tool" and "calculater" in r.content and "calculator" in r.content
    assert box.stats()["unknown_tool"] == 1 and box.stats()["per_tool"] == {}


# ---------------------------------------------------------------- schemas
def test_schemas_of_typed_functions_from_a_user_folder(user_dir):
    defs = load_tools([f"{USER_MODULE}:multiply", f"{USER_MODULE}.py:sleepy", "calculator"], None)
    assert [d.name for d in defs] == ["multiply", "sleepy", "calculator"]
    fn = defs[0].schema["function"]
    assert fn["description"] == "Multiply two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert defs[1].schema["function"]["parameters"]["properties"]["seconds"]["type"] == "number"
    box = ToolBox.from_config(GRPOConfig(tools=["calculator", f"{USER_MODULE}:multiply"]))
    try:
        assert [s["function"]["name"] for s in box.schemas] == ["calculator", "multiply"]
    finally:
        box.close()


def test_an_environment_class_gives_its_public_methods_but_reset_and_get_reward(user_dir):
    defs = load_tools([], f"{USER_MODULE}:Counter")
    assert [(d.name, d.where) for d in defs] == [("add", "env")]
    assert defs[0].schema["function"]["parameters"]["properties"]["amount"]["type"] == "integer"


@pytest.mark.parametrize("spec, says", [
    ("untyped", "untyped because it has no docstring"),
    ("no_args_doc", "no description for the argument 'a'"),
    ("Counter", "is a class"),
    ("missing", "has no callable 'missing'"),
])
def test_a_tool_without_types_or_docstring_fails_early_in_one_line(user_dir, spec, says):
    with pytest.raises(ValueError, match=says) as e:
        load_tools([f"{USER_MODULE}:{spec}"], None)
    assert "\n" not in str(e.value)


def test_two_tools_of_one_name_are_refused(user_dir):
    with pytest.raises(ValueError, match="two tools are called 'multiply'"):
        load_tools([f"{USER_MODULE}:multiply", f"{USER_MODULE}.py:multiply"], None)


def test_no_tools_no_toolbox():
    assert ToolBox.from_config(GRPOConfig()) is None


# ---------------------------------------------------------------- calculator
@pytest.mark.parametrize("expr, value", [
    ("123 * 456 + 7", "56095"), ("-(3 + 4) * 2", "-14"), ("7 / 2", "3.5"), ("10 // 3", "3"), ("10 % 3", "1"),
    ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("((1 + 2) * (3 + 4))", "21"), ("1.5e3 + 1", "1501.0"),
    ("987654321 * 123456789", "121932631112635269"),
])
def test_calculator_computes(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr, says", [
    ("x + 1", "the name 'x'"), ("abs(-3)", "function call"), ("__import__('os')", "function call"),
    ("().__class__", "Attribute"), ("2 ** 1000", "exponent 1000"), ("9 ** 9 ** 9", "exponent 387420489"),
    ("10 ** 100", "bound"), ("1 / 0", "division by zero"), ("'a' * 3", "Constant"),
    ("1 < 2", "Compare"), ("[1, 2]", "List"), ("1 +", "not an arithmetic expression"), ("1" * 600, "longer than"),
    ("+".join(["1"] * 150), "more than"),
])
def test_calculator_refuses(expr, says):
    with pytest.raises(CalculatorError, match=says):
        calculator(expr)


def test_a_calculator_refusal_is_an_error_result_the_model_reads():
    box = calc_box()
    [ep] = box.start_episodes(1)
    [[ok, bad]] = box.run([(ep, [ToolCall("calculator", {"expression": "6 * 7"}),
                                 ToolCall("calculator", {"expression": "open('x')"})])])
    assert (ok.status, ok.content) == ("ok", "42")
    assert bad.status == "error" and bad.content.startswith("Error: CalculatorError: a function call")
    assert box.stats()["per_tool"]["calculator"] == {"calls": 2, "failed": 1, "timed_out": 0,
                                                     "seconds": pytest.approx(ok.seconds + bad.seconds)}
    box.reset_stats()
    assert box.stats()["calls"] == 0


def test_calls_and_results_as_chat_messages():
    """The shapes apply_chat_template and TRL's reward functions take."""
    assert ToolCall("f", {"a": 1}).to_dict() == {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    assert ToolCall("f", {}, id="c1").to_dict()["id"] == "c1"
    assert ToolResult("f", "x", "ok").to_message() == {"role": "tool", "name": "f", "content": "x"}


# ---------------------------------------------------------------- config
def test_config_fields_default_to_no_tools():
    cfg = GRPOConfig()
    assert (cfg.tools, cfg.environment_factory, cfg.max_tool_calling_iterations) == ([], None, None)
    assert cfg.tool_timeout > 0 and cfg.tool_output_chars > 0


def test_tools_on_the_command_line_and_in_json(tmp_path):
    cfg = load_config(GRPOConfig, ["--tools", "calculator,python", "--max_tool_calling_iterations", "3"])
    assert cfg.tools == ["calculator", "python"] and cfg.max_tool_calling_iterations == 3
    path = tmp_path / "c.json"
    path.write_text('{"tools": ["calculator", "my_tools.py:search"], "environment_factory": "envs:Game", '
                    '"tool_timeout": 5}')
    cfg = load_config(GRPOConfig, ["--config", str(path)])
    assert cfg.tools == ["calculator", "my_tools.py:search"] and cfg.environment_factory == "envs:Game"
    assert from_dict(GRPOConfig, {"tools": "calculator"}).tools == ["calculator"]  # a string, as reward_fns
    assert load_config(GRPOConfig, ["--max_tool_calling_iterations", "null"]).max_tool_calling_iterations is None


@pytest.mark.parametrize("values, says", [
    ({"tools": ["calculatr"]}, "neither a built-in tool"),
    ({"tools": ["calculator", "calculator"]}, "given more than once"),
    ({"tools": [""]}, "is not a name"),
    ({"environment_factory": "Game"}, "names no class"),
    ({"max_tool_calling_iterations": -1}, "max_tool_calling_iterations must be >= 0"),
    ({"tool_timeout": 0.0}, "tool_timeout must be > 0"),
    ({"tool_output_chars": 10}, "tool_output_chars must be >= 50"),
])
def test_config_validation_errors_are_one_line(values, says):
    with pytest.raises(ValueError, match=says) as e:
        from_dict(GRPOConfig, values).validate()
    assert "\n" not in str(e.value)


def test_zero_iterations_is_allowed():
    """TRL: max_tool_calling_iterations 0 = the tools are in the prompt, a call is never run."""
    assert from_dict(GRPOConfig, {"tools": ["calculator"], "max_tool_calling_iterations": 0}).validate()


def test_check_has_one_fail_line_per_bad_tool(user_dir, capsys):
    from trainer.check import main
    code = main(["--ref-url", "http://x", "--", "--data", "arith", "--tools",
                 f"calculator,{USER_MODULE}:multiply,{USER_MODULE}:untyped,nosuch_mod_32:fn"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " tools " in ln]
    assert code == 1
    assert [ln.split()[0] for ln in lines] == ["ok", "ok", "FAIL", "FAIL"], lines
    assert "untyped" in lines[2] and "nosuch_mod_32" in lines[3]
