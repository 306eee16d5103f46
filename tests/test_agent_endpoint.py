"""The agent endpoint (trainer/agents/) driven by the real openai SDK: a session's calls recorded token-exact (the
trained ids are the ids the engine consumed and sampled), tool calls parsed into OpenAI's tool_calls, streaming,
the session's limits, batching of concurrent requests, and OpenAI's error shapes."""
from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import openai
import pytest

from tests.agent_doubles import ScriptedEngine, SpyEngine
from tests.tool_doubles import spelled
from trainer.agents import rollout_of, serve
from trainer.agents.chat import prompt_ids
from trainer.tools.multi_turn import tool_suffix_ids

CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
Q = [{"role": "user", "content": "What is 12 * 34?"}]


@pytest.fixture(scope="module")
def tok():
    from common.tiny_model import build_tokenizer
    return build_tokenizer()


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def endpoint():
    """endpoint(engine, **limits) -> (server, session, client); every server is closed after the test."""
    servers = []

    def make(engine, **kw):
        srv = serve(engine, engine.tok, model="policy", **{"max_new_tokens": 200, "max_prompt_length": 400, **kw})
        servers.append(srv)
        s = srv.endpoint.open_session()
        return srv, s, openai.OpenAI(base_url=srv.base_url(s), api_key="anything", max_retries=0, timeout=60)

    yield make
    for srv in servers:
        srv.close()


def ask(client, messages, **kw):
    return client.chat.completions.create(model="policy", messages=messages, **kw)


def test_two_call_session_trains_the_ids_the_engine_sampled(tiny_model_dir, endpoint):
    """The real HF engine on the tiny model: an answer, then a follow-up user turn. The row is one sequence: the
    first prompt, what the engine sampled, the template's tokens for the new turn (masked), what it sampled next."""
    from common.config import GRPOConfig
    from trainer.engines import make_engine
    cfg = GRPOConfig(model=str(tiny_model_dir), gen_backend="hf", temperature=1.0, gen_batch_size=8).validate()
    eng = SpyEngine(make_engine(cfg, str(tiny_model_dir)))
    eng.tok = eng.engine.tok
    srv, s, client = endpoint(eng, max_new_tokens=48)
    first = ask(client, [{"role": "user", "content": "What is 2 + 3?"}], max_tokens=16)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, first.choices[0].message.model_dump(),
            {"role": "user", "content": "Are you sure?"}]
    second = ask(client, msgs, max_completion_tokens=16)
    (p1, s1), (p2, s2) = eng.rec.served()
    (row,), completion, stats = rollout_of(s)
    added = p2[len(p1) + len(s1):]
    assert p2[:len(p1) + len(s1)] == p1 + s1  # call 2 consumed call 1's recorded ids, not a re-rendering
    assert row.prompt_ids == p1 and row.completion_ids.tolist() == s1 + added + s2
    assert row.loss_mask.tolist() == [True] * len(s1) + [False] * len(added) + [True] * len(s2)
    end = [] if s1[-1] in eng.eos_ids else [eng.tok.convert_tokens_to_ids("<|im_end|>")]  # a `length` reply closed
    assert added == end + enc(eng.tok, "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n")
    # the HF engine's own logprobs (issue 62: from generate's logits): the sampled tokens', 0 on the template's
    lp = row.logprobs.tolist()
    assert len(lp) == len(row.completion_ids) and all(x < 0 for x in lp[:len(s1)] + lp[len(s1) + len(added):])
    assert lp[len(s1):len(s1) + len(added)] == [0.0] * len(added)
    assert first.usage.prompt_tokens == len(p1) and first.usage.completion_tokens == len(s1)
    assert second.usage.prompt_tokens == len(p2) and second.usage.completion_tokens == len(s2)
    assert [m["role"] for m in completion] == ["assistant", "user", "assistant"]
    assert completion[2]["content"] == second.choices[0].message.content
    assert stats["segments"] == 1 and stats["turns"] == 2 and stats["policy_versions"] == [0, 0]


def test_scripted_turns_survive_exactly_with_their_logprobs(tok, endpoint):
    """Turns no BPE would produce (spelled one character per token) come back as sampled, with the sampler's
    logprobs, in the row and in the response's logprobs."""
    t1, t2 = spelled(tok, "<answer> 408 </answer>") + [tok.eos_token_id], spelled(tok, "yes") + [tok.eos_token_id]
    assert enc(tok, tok.decode(t1)) != t1  # re-tokenising would change them
    eng = ScriptedEngine(tok, [t1, t2])
    _, s, client = endpoint(eng)
    r1 = ask(client, Q, logprobs=True)
    assert r1.choices[0].finish_reason == "stop" and r1.choices[0].message.content == "<answer> 408 </answer>"
    lp = [-(i + 1) / 100 for i in range(len(t1))]
    assert [x.logprob for x in r1.choices[0].logprobs.content] == pytest.approx(lp)
    ask(client, Q + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}])
    (row,), _, _ = rollout_of(s)
    added = enc(tok, "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n")  # t1 closed its own turn
    assert row.completion_ids.tolist() == t1 + added + t2
    assert row.logprobs.tolist() == pytest.approx(lp + [0.0] * len(added) + [-(i + 1) / 100 for i in range(len(t2))])


def test_tool_calls_parsed_and_the_tool_turn_appended_as_the_tool_loop_does(tok, endpoint):
    t1 = spelled(tok, "<think> x </think>\n") + enc(tok, CALL) + [tok.eos_token_id]
    t2 = spelled(tok, "<answer> 408 </answer>") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [t1, t2])
    _, s, client = endpoint(eng)
    r1 = ask(client, Q, tools=[MUL], tool_choice="auto")
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.function.name == "mul" and json.loads(call.function.arguments) == {"a": 12, "b": 34}
    assert call.id.startswith("call_")
    # the agent echoes the reply as the SDK gives it (arguments a JSON string) and answers the call
    msgs = Q + [choice.message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "408"}]
    r2 = ask(client, msgs, tools=[MUL])
    assert r2.choices[0].finish_reason == "stop"
    assert eng.rec.calls[0][0][0] == prompt_ids(tok, Q, [MUL])  # the tools in the prompt, as the template renders
    (row,), completion, _ = rollout_of(s)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "408"}])  # the tool loop's own
    assert row.completion_ids.tolist() == t1 + suffix + t2
    assert row.loss_mask.tolist() == [True] * len(t1) + [False] * len(suffix) + [True] * len(t2)
    assert completion[0]["tool_calls"][0]["function"] == {"name": "mul", "arguments": {"a": 12, "b": 34}}
    assert completion[1] == {"role": "tool", "content": "408"} and completion[2]["content"] == "<answer> 408 </answer>"


def test_a_rewritten_history_is_a_new_segment_never_retokenised(tok, endpoint):
    t = spelled(tok, "ok") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [t])
    _, s, client = endpoint(eng)
    r1 = ask(client, Q)
    other = [{"role": "user", "content": "Start over: 5 * 5?"}]
    ask(client, other)  # not Q + reply + ...: the agent cut its history
    ask(client, other + [{"role": "assistant", "content": "changed"}, {"role": "user", "content": "?"}])
    rows, completion, stats = rollout_of(s)
    assert stats["segments"] == 3 and len(rows) == 3
    assert [r.prompt_ids for r in rows] == [p for p, _ in eng.rec.served()]
    assert rows[1].prompt_ids == prompt_ids(tok, other, None)
    assert all(r.completion_ids.tolist() == t and r.loss_mask.all() for r in rows)
    assert completion[0]["content"] == r1.choices[0].message.content and len(completion) == 3


def test_the_session_budget_and_call_limit_answer_length_without_generating(tok, endpoint):
    """max_new_tokens bounds a row's tokens after its prompt (as the tool loop counts them) and the session's
    sampled tokens over all its segments; max_calls its calls. A call past them: `length`, nothing generated."""
    eng = ScriptedEngine(tok, [spelled(tok, "abcdefghijklmnopqrstuvwxyz")])  # no eos: each call fills its budget
    _, s, client = endpoint(eng, max_new_tokens=30)
    r1 = ask(client, Q, max_tokens=4)
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 4
    msgs = Q + [r1.choices[0].message.model_dump(), {"role": "user", "content": "go on"}]
    r2 = ask(client, msgs)
    added = len(eng.rec.calls[1][0][0]) - len(eng.rec.calls[0][0][0]) - 4
    assert eng.rec.calls[1][1] == [30 - 4 - added] and r2.choices[0].finish_reason == "length"
    r3 = ask(client, msgs + [r2.choices[0].message.model_dump(), {"role": "user", "content": "more"}])
    assert r3.choices[0].finish_reason == "length" and r3.choices[0].message.content == ""
    assert len(eng.rec.calls) == 2  # the row is full: answered without the engine
    ask(client, [{"role": "user", "content": "new history"}])  # a new segment: the session's sampled tokens left
    assert eng.rec.calls[2][1] == [added]  # 30 - (4 + 26 - added) sampled before it
    assert s.stats()["sampled_tokens"] == 30 and s.stats()["refused"] == 1
    _, s2, client2 = endpoint(ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]]), max_calls=1)
    ask(client2, Q)
    late = ask(client2, Q)
    assert late.choices[0].finish_reason == "length" and late.choices[0].message.content == ""
    assert s2.stats()["refused"] == 1 and s2.stats()["turns"] == 1


def test_streaming_sends_the_reply_as_openai_chunks(tok, endpoint):
    t1 = spelled(tok, "<think> x </think>\n") + enc(tok, CALL) + [tok.eos_token_id]
    _, s, client = endpoint(ScriptedEngine(tok, [t1, spelled(tok, "hi") + [tok.eos_token_id]]))
    chunks = list(ask(client, Q, tools=[MUL], stream=True, stream_options={"include_usage": True}))
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert calls[0].function.name == "mul" and json.loads(calls[0].function.arguments) == {"a": 12, "b": 34}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(t1)
    echoed = {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
        "name": "mul", "arguments": calls[0].function.arguments}}]}  # from the deltas, as a streaming agent does
    text = list(ask(client, Q + [echoed, {"role": "tool", "tool_call_id": calls[0].id, "content": "408"}],
                    tools=[MUL], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in text) == "hi"
    assert s.stats()["segments"] == 1  # the streamed reply, echoed back, extends the session


def test_concurrent_requests_are_served_by_one_engine_call(tok, endpoint):
    eng = ScriptedEngine(tok, [], delay=0.3, by_prompt=lambda p: p[-4:-2] + [tok.eos_token_id])
    srv, _, _ = endpoint(eng)
    sessions = [srv.endpoint.open_session() for _ in range(8)]
    replies = {}

    def agent(i, s):
        c = openai.OpenAI(base_url=srv.base_url(s), api_key=f"key-{i}", max_retries=0, timeout=60)
        replies[i] = ask(c, [{"role": "user", "content": f"question {i}"}])

    threads = [threading.Thread(target=agent, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(replies) == 8 and len(eng.rec.calls) <= 2  # 8 requests, one engine call (two if one came late)
    for s in sessions:  # each session got the completion of its own prompt
        (row,) = s.rows()
        assert row.completion_ids.tolist() == row.prompt_ids[-4:-2] + [tok.eos_token_id]


def test_stop_strings_cut_the_reply_and_the_turn_is_closed_after(tok, endpoint):
    t = spelled(tok, "abc STOP def") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [t])
    _, s, client = endpoint(eng)
    r = ask(client, Q, stop=["STOP"])
    assert r.choices[0].message.content == "abc " and r.choices[0].finish_reason == "stop"
    kept = len(spelled(tok, "abc STOP"))
    ask(client, Q + [r.choices[0].message.model_dump(), {"role": "user", "content": "x"}])
    (row,), _, _ = rollout_of(s)
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    assert row.completion_ids.tolist()[:kept + 1] == t[:kept] + end


def test_text_completions_extend_by_prefix_and_models_lists_the_policy(tok, endpoint):
    t1, t2 = spelled(tok, "12"), spelled(tok, "34") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [t1, t2])
    _, s, client = endpoint(eng)
    assert [m.id for m in client.models.list()] == ["policy"]
    r1 = client.completions.create(model="policy", prompt="Count:", max_tokens=2, logprobs=0)
    assert r1.choices[0].text == "12" and r1.choices[0].finish_reason == "length"
    assert r1.choices[0].logprobs.token_logprobs == pytest.approx([-0.01, -0.02])
    client.completions.create(model="policy", prompt="Count:" + r1.choices[0].text + " next")
    (row,), completion, _ = rollout_of(s)
    assert row.completion_ids.tolist() == t1 + enc(tok, " next") + t2
    assert row.loss_mask.tolist() == [True] * 2 + [False] * len(enc(tok, " next")) + [True] * len(t2)
    assert completion == [{"role": "assistant", "content": "12"}, {"role": "assistant", "content": "34"}]


def test_sampling_is_the_runs_and_said_once(tok, endpoint, caplog):
    _, _, client = endpoint(ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]]), temperature=1.0)
    with caplog.at_level(logging.INFO, logger="trainer.agents"):
        ask(client, Q, temperature=0.2, top_p=0.5)
        ask(client, Q, temperature=0.3)
    said = [r.message for r in caplog.records if "temperature=0.2" in r.message or "temperature=0.3" in r.message]
    assert len(said) == 1 and "not applied" in said[0]


def test_bad_requests_get_openai_errors_never_a_5xx(tok, endpoint):
    eng = ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]])
    srv, s, client = endpoint(eng)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, Q, n=2)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        ask(client, [{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="arguments are not JSON"):
        ask(client, Q + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "mul", "arguments": "{oops"}}]}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        ask(client, Q, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        ask(client, Q, max_completion_tokens=0, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="max_prompt_length 400") as e:
        ask(client, [{"role": "user", "content": "x " * 500}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=Q)
    gone = openai.OpenAI(base_url=srv.base_url(s).replace(s.id, "not-a-session"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no such session"):
        ask(gone, Q)
    url = srv.base_url(s)
    for method, path, data in [("POST", "/chat/completions", b"{not json"), ("POST", "/chat/completions", b"[1]"),
                               ("POST", "/chat/completions", b'{"model": "policy"}'),
                               ("POST", "/chat/completions", b'{"model": "policy", "messages": [{"role": "user"}]}'),
                               ("POST", "/chat/completions", b'{"model": "policy", "messages": [], "stream": 3}'),
                               ("POST", "/completions", b'{"model": "policy", "prompt": ["a", "b"]}'),
                               ("POST", "/completions", b'{"model": "policy", "prompt": [1, 99999999]}'),
                               ("GET", "/chat/completions", None), ("POST", "/nothing", b"{}")]:
        r = httpx.request(method, url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500, (path, data, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, data)
    assert eng.rec.calls == []  # nothing refused reached the engine
    ask(client, Q)  # and the session still serves


def test_messages_the_chat_template_refuses_are_a_400(tok, endpoint):
    import copy
    strict = copy.deepcopy(tok)
    strict.chat_template = ("{%- for m in messages %}{%- if m['role'] == 'developer' %}"
                            "{{- raise_exception('this template has no developer role') }}{%- endif %}{%- endfor %}"
                            + tok.chat_template)
    _, s, client = endpoint(ScriptedEngine(strict, [spelled(tok, "a") + [tok.eos_token_id]]))
    with pytest.raises(openai.BadRequestError, match="no developer role"):
        ask(client, [{"role": "developer", "content": "be brief"}, *Q])
    assert ask(client, Q).choices[0].message.content == "a"  # a model TRL cannot parse: its text is the content


@pytest.fixture(scope="module")
def vllm_probe(tiny_model_dir) -> dict:
    """tests/agent_vllm_probe.py: the endpoint over the real vLLM engine, in a child process (vLLM's own thread
    and torch.distributed settings stay out of pytest's)."""
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    proc = subprocess.run([sys.executable, "-m", "tests.agent_vllm_probe", str(tiny_model_dir)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_vllm_two_call_session_trains_the_sampled_ids_with_the_samplers_logprobs(vllm_probe):
    r = vllm_probe
    assert "error" not in r, r
    assert r["context_reused"] and r["row_is_sampled"] and r["mask_ok"] and r["segments"] == 1
    assert r["row_logprobs"] == r["engine_logprobs"] == r["response_logprobs"]  # the sampler's, in row and reply
    assert r["masked_logprobs"] and set(r["masked_logprobs"]) == {0.0}
    assert r["roles"] == ["assistant", "user", "assistant"]
    # 8 agents at once: served by vLLM's batching in at most 2 engine calls, each its own completion
    assert r["concurrent_done"] == 8 and r["concurrent_engine_calls"] <= 2 and r["rows_match"]


def test_a_refused_request_leaves_its_keep_alive_connection_usable(tok, endpoint):
    srv, s, _ = endpoint(ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]]))
    with httpx.Client(base_url=srv.base_url(s), timeout=30) as c:  # one pooled connection for both requests
        assert c.post("/nothing", content=b'{"model": "policy", "messages": []}').status_code == 404
        ok = c.post("/chat/completions", json={"model": "policy", "messages": Q})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "a"


def test_each_call_records_its_policy_version_and_a_weight_load_never_lands_inside_one(tok):
    version = [0]
    eng = ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]], delay=0.3)
    srv = serve(eng, tok, model="policy", max_new_tokens=50, max_prompt_length=400, version=lambda: version[0])
    try:
        s = srv.endpoint.open_session()
        client = openai.OpenAI(base_url=srv.base_url(s), api_key="x", max_retries=0, timeout=30)
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", ask(client, Q)))
        t.start()
        while not srv.endpoint.batcher.lock.locked():  # the call is in the engine
            time.sleep(0.001)
        with srv.endpoint.batcher.lock:  # what a weight load takes
            assert len(eng.rec.calls) == 1  # the call in flight had finished
            version[0] = 1
        t.join(30)
        ask(client, Q + [first["r"].choices[0].message.model_dump(), {"role": "user", "content": "again"}])
        assert s.stats()["policy_versions"] == [0, 1] and [c.version for c in s.segments[0].calls] == [0, 1]
    finally:
        srv.close()


def test_an_engine_failure_is_a_500_for_its_requests_and_the_endpoint_serves_on(tok, endpoint):
    class Flaky(ScriptedEngine):
        def generate(self, prompt_ids, n, *, max_new_tokens, greedy=False):
            if not self.rec.calls and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("engine fell over")
            return super().generate(prompt_ids, n, max_new_tokens=max_new_tokens, greedy=greedy)

    _, _, client = endpoint(Flaky(tok, [spelled(tok, "a") + [tok.eos_token_id]]))
    with pytest.raises(openai.InternalServerError, match="engine fell over") as e:
        ask(client, Q)
    assert e.value.body["type"] == "server_error"
    assert ask(client, Q).choices[0].message.content == "a"


def test_a_rounds_agents_connecting_at_once_are_all_accepted(tok, endpoint):
    srv, s, _ = endpoint(ScriptedEngine(tok, [spelled(tok, "a") + [tok.eos_token_id]]))
    gate, codes = threading.Barrier(96), []

    def connect():
        gate.wait()
        try:
            codes.append(httpx.get(srv.base_url(s) + "/models", timeout=30).status_code)
        except httpx.TransportError as e:
            codes.append(type(e).__name__)

    threads = [threading.Thread(target=connect) for _ in range(96)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes == [200] * 96
