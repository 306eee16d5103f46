"""An agent written against the OpenAI API, trained unchanged (`./launch.sh demo --agent`, docs/agents.md).

It offers one function tool, `calculator`, to the model (tool_choice "auto"): when the reply calls it, the agent
computes the expression itself, sends the result back as a `tool` message and asks again for the final answer.
The trainer calls `solve` once per rollout with `base_url` (this rollout's endpoint, which records every token),
`model` and the example's `prompt` (here "37*48+5"); the rewards score the conversation it had (the config's
reward_fns: trainer/demo/tool_task.py `reward_agent_answer`), so it returns None.

Self-contained (the openai SDK and the standard library): it runs from your own folder, as your agent would.
    agent: "calculator_agent.py:solve"            in the config, with this file in the folder you run from
"""
from __future__ import annotations

import ast
import json
import operator

import openai

# The tool's schema, exactly as the trainer's built-in calculator describes itself (transformers'
# get_json_schema of trainer/tools/calculator.py): the chat template prints it into the prompt, so the
# same text here means the same prompt tokens the tool demo's cold-start SFT taught.
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The arithmetic expression to evaluate, using numbers, + - * / // % ** and "
                                   "parentheses, for example \"123 * 456 + 7\".",
                }
            },
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """Plain arithmetic by its syntax tree (no eval): numbers, + - * / // % and parentheses; else an error line."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return ev(node.operand) if isinstance(node.op, ast.UAdd) else -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only numbers, + - * / // % and parentheses")
    try:
        return str(ev(ast.parse(str(expression).strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


def solve(base_url: str, model: str, prompt, **columns) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)  # any key: the URL is the secret
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    try:
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                               tool_choice="auto").choices[0].message
        if not reply.tool_calls:
            return None  # answered by itself
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = call.function.arguments
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
        client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], tool_choice="auto")
    finally:
        client.close()
    return None

