"""How the model loads (issue 31): trust_remote_code, attn_implementation, revision and model_init_kwargs reach
every process that calls from_pretrained: the ranks (trainer/deepspeed_policy.py build_engine, one gloo rank), a genonly
worker's HF engine, the ref server process, `python -m trainer.evaluate`, and the ref server launch.sh starts
(common/placement/launch_plan.py hands it the trainer's options). The model is the tiny one with its own code
(auto_map), which loads only with trust_remote_code; revisions come from a local Hugging Face cache (nothing
downloads)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, find_free_port, start_ref_server, subprocess_env

from common.config import GRPOConfig
from common.modeling import load_model, load_model_config, load_tokenizer
from common.settings.knobs import load_config

CONFIG_CODE = """from transformers import Qwen2Config


class GrpoCustomConfig(Qwen2Config):
    model_type = "grpo_custom"
"""
MODEL_CODE = """from transformers import Qwen2ForCausalLM

from .configuration_grpo_custom import GrpoCustomConfig


class GrpoCustomForCausalLM(Qwen2ForCausalLM):
    config_class = GrpoCustomConfig
"""
CUSTOM = "GrpoCustomForCausalLM"


def env(**extra: str) -> dict:
    return subprocess_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}", **extra)


@pytest.fixture(scope="module")
def custom_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model whose config.json names its own classes (auto_map): runs only with trust_remote_code."""
    d = tmp_path_factory.mktemp("custom") / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "configuration_grpo_custom.py").write_text(CONFIG_CODE)
    (d / "modeling_grpo_custom.py").write_text(MODEL_CODE)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="grpo_custom", architectures=[CUSTOM],
               auto_map={"AutoConfig": "configuration_grpo_custom.GrpoCustomConfig",
                         "AutoModelForCausalLM": f"modeling_grpo_custom.{CUSTOM}"})
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def test_load_helpers_pass_the_options(custom_dir):
    trusted = GRPOConfig(trust_remote_code=True, attn_implementation="eager").validate().load_options()
    model = load_model(str(custom_dir), options=trusted)
    assert type(model).__name__ == CUSTOM and model.config._attn_implementation == "eager"
    assert type(load_model_config(str(custom_dir), trusted)).__name__ == "GrpoCustomConfig"
    assert load_tokenizer(str(custom_dir), trusted).pad_token is not None
    # not trusted: refused at once (said explicitly: transformers would otherwise ask on stdin and wait)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(str(custom_dir), options=GRPOConfig().load_options())
    assert type(load_model(str(custom_dir), options={"trust_remote_code": True, "use_cache": False})
                ).__name__ == CUSTOM  # model_init_kwargs reach from_pretrained
    model = load_model(str(custom_dir), options=GRPOConfig(
        trust_remote_code=True, model_init_kwargs={"attn_implementation": "sdpa"}).validate().load_options())
    assert model.config._attn_implementation == "sdpa"


def test_genonly_worker_hf_engine_loads_with_the_options(custom_dir):
    from trainer.engines.hf import HFEngine

    cfg = load_config(GRPOConfig, ["--model", str(custom_dir), "--trust-remote-code", "true",
                                   "--attn_implementation", "eager", "--device", "cpu"])
    engine = HFEngine.from_config(cfg, str(custom_dir))
    assert type(engine.model).__name__ == CUSTOM and engine.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFEngine.from_config(load_config(GRPOConfig, ["--device", "cpu"]), str(custom_dir))


@pytest.mark.multiproc  # a DeepSpeed rank process, twice (~10 CPU-s)
def test_ranks_build_engine_loads_with_the_options(custom_dir, tmp_path):
    """One real DeepSpeed rank (gloo) through trainer/deepspeed_policy.py build_engine (tests/update_probe.py)."""
    run = [sys.executable, str(REPO / "tests" / "update_probe.py"), str(custom_dir), str(tmp_path),
           "--all_steps", "1", "--beta", "0"]

    def probe(*flags: str) -> subprocess.CompletedProcess:
        e = env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(find_free_port()))
        return subprocess.run([*run, *flags], cwd=REPO, env=e, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)

    ok = probe("--trust_remote_code", "true")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert json.loads(ok.stdout.strip().splitlines()[-1])[0]["moved"]
    refused = probe()
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr


def test_ref_server_loads_with_the_options(custom_dir):
    import requests

    with start_ref_server(custom_dir, "--trust-remote-code", "--attn-implementation", "eager", env=env()) as srv:
        assert requests.get(srv.url + "/health", timeout=10).ok  # loaded: it refuses without the option
    r = subprocess.run([sys.executable, "-m", "ref_server", "--model", str(custom_dir), "--port",
                        str(find_free_port())], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "trust_remote_code" in r.stdout + r.stderr


def test_evaluate_cli_loads_with_the_options(custom_dir, tmp_path):
    cmd = [sys.executable, "-m", "trainer.evaluate", "--model", str(custom_dir), "--data", "arith", "--split", "test",
           "--limit", "2", "--max_new_tokens", "2", "--system-prompt", "", "--out", str(tmp_path / "e.json")]
    ok = subprocess.run([*cmd, "--trust-remote-code", "true", "--attn_implementation", "eager"], cwd=REPO, env=env(),
                        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert json.loads((tmp_path / "e.json").read_text())["n"] == 2
    refused = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr


def test_launch_hands_the_ref_server_the_trainers_options(capsys):
    """launch.sh evals placement_cli's PLAN_REF_ARGS into the ref server's command line."""
    import shlex

    from common.placement.launch_plan import main
    from ref_server.config import load_server_config

    assert main(["--workers", "0", "--", "--trust-remote-code", "true", "--revision", "v1",
                 "--model_init_kwargs", '{"use_cache": false}']) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("PLAN_REF_ARGS="))
    args = shlex.split(line[len("PLAN_REF_ARGS=("):-1])
    srv = load_server_config(["--model", "m", *args])
    assert srv.load_options() == {"trust_remote_code": True, "revision": "v1", "use_cache": False}
    assert main(["--workers", "0", "--"]) == 0
    assert "PLAN_REF_ARGS=()" in capsys.readouterr().out


def _hub_cache(root: Path, tiny: Path) -> Path:
    """A Hugging Face cache holding org/tiny at two revisions: main and the tag v1 (config says which)."""
    repo = root / "models--org--tiny"
    for rev, sha in (("main", "a" * 40), ("v1", "b" * 40)):
        snap = repo / "snapshots" / sha
        shutil.copytree(tiny, snap)
        cfg = json.loads((snap / "config.json").read_text())
        (snap / "config.json").write_text(json.dumps({**cfg, "grpo_revision": rev}))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / rev).write_text(sha)
    return root


def test_revision_reaches_model_tokenizer_config_and_lora_base(tiny_model_dir, tmp_path):
    cache = _hub_cache(tmp_path / "hub", tiny_model_dir)
    script = """
import json, sys
from common.config import GRPOConfig
from common.settings.knobs import load_config
from common.modeling import load_model, load_model_config, load_tokenizer
from common.paths import local_model_dir
for argv in json.loads(sys.argv[1]):
    cfg = load_config(GRPOConfig, ["--model", "org/tiny", *argv])
    o = cfg.load_options()
    print(json.dumps([load_model(cfg.model, options=o).config.grpo_revision,
                      load_model_config(cfg.model, o).grpo_revision, load_tokenizer(cfg.model, o).name_or_path,
                      json.load(open(local_model_dir(cfg.model, o.get("revision")) / "config.json"))["grpo_revision"]]))
"""
    cases = [(["--revision", "v1"], "v1"), (["--model_revision", "v1"], "v1"),
             (["--model_init_kwargs", '{"revision": "v1"}'], "v1"), ([], "main")]
    r = subprocess.run([sys.executable, "-c", script, json.dumps([a for a, _ in cases])], cwd=REPO,
                       env=env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("[")]
    for (argv, want), got in zip(cases, rows, strict=True):
        assert got[0] == got[1] == got[3] == want and got[2] == "org/tiny", (argv, got)
