"""Run by tests/test_agent_endpoint.py in its own process (vLLM's engine sets up its own torch.distributed group
and thread settings): the agent endpoint over the real vLLM engine on the tiny model, driven by the openai SDK.
Prints one JSON line.

    python tests/agent_vllm_probe.py TINY_MODEL_DIR
"""
from __future__ import annotations

import json
import logging
import sys
import threading


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    import openai

    from common.config import GRPOConfig
    from tests.agent_doubles import SpyEngine
    from trainer.agents import rollout_of, serve
    from trainer.engines import make_engine

    cfg = GRPOConfig(model=sys.argv[1], gen_backend="vllm", vllm_dtype="float32", temperature=1.0,
                     max_new_tokens=64, max_prompt_length=96, seed=5).validate()
    eng = SpyEngine(make_engine(cfg, sys.argv[1]))
    eng.tok = eng.engine.tok
    srv = serve(eng, eng.tok, model="policy", max_new_tokens=64, max_prompt_length=96)
    s = srv.endpoint.open_session()
    client = openai.OpenAI(base_url=srv.base_url(s), api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r1 = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, logprobs=True)
    msgs += [r1.choices[0].message.model_dump(), {"role": "user", "content": "Are you sure?"}]
    r2 = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, logprobs=True)
    if len(eng.rec.served()) != 2:
        print(json.dumps({"error": "expected 2 engine requests", "served": eng.rec.served(), "stats": s.stats(),
                          "r1": r1.model_dump(), "r2": r2.model_dump()}))
        return
    (p1, s1), (p2, s2) = eng.rec.served()
    (row,), completion, stats = rollout_of(s)
    added = p2[len(p1) + len(s1):]
    mask = row.loss_mask.tolist()
    res = {
        "context_reused": p2[:len(p1) + len(s1)] == p1 + s1,
        "row_is_sampled": row.prompt_ids == p1 and row.completion_ids.tolist() == s1 + added + s2,
        "mask_ok": mask == [True] * len(s1) + [False] * len(added) + [True] * len(s2),
        "response_logprobs": [x.logprob for x in r1.choices[0].logprobs.content + r2.choices[0].logprobs.content],
        "row_logprobs": [lp for lp, m in zip(row.logprobs.tolist(), mask) if m],
        "masked_logprobs": [lp for lp, m in zip(row.logprobs.tolist(), mask) if not m],
        "engine_logprobs": [x for _, _, ss in eng.rec.calls for smp in ss for x in smp.logprobs.tolist()],
        "roles": [m["role"] for m in completion], "segments": stats["segments"],
    }
    calls_before = len(eng.rec.calls)
    sessions = [srv.endpoint.open_session() for _ in range(8)]
    done = []

    def agent(sess, i):
        c = openai.OpenAI(base_url=srv.base_url(sess), api_key="x", max_retries=0, timeout=120)
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"q {i}"}], max_tokens=8)
        done.append(i)

    threads = [threading.Thread(target=agent, args=(x, i)) for i, x in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    res["concurrent_done"] = len(done)
    res["concurrent_engine_calls"] = len(eng.rec.calls) - calls_before
    served = {tuple(p): c for p, c in eng.rec.served()}
    res["rows_match"] = all(served[tuple(x.rows()[0].prompt_ids)] == x.rows()[0].completion_ids.tolist()
                            for x in sessions)
    srv.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
