"""Shared test helpers: the tiny model, free ports, and a real ref server process.

    def test_x(start_server, tiny_model_dir):
        with start_server(tiny_model_dir, "--max-queue", "4") as srv:
            requests.get(srv.url + "/health")
"""
from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import xdist_filler
from xdist_filler import (  # noqa: F401 - the filler's hooks: pytest finds them in this module
    pytest_addoption,
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)

REPO = Path(__file__).resolve().parent.parent
# The venv's bin/ first, as launch.sh does for its processes. torch JIT-builds DeepSpeed's CPU op
# (deepspeed_shm_comm) with the first `ninja` on PATH: the venv's (1.13, which launch.sh's ranks find) and the
# system's (1.11, which in-process and directly started ranks found) each take the other's .ninja_log entries
# as stale, so every switch rebuilt the op: 3 builds of ~2 min on both cores in one suite run, ranks waiting on
# its lock meanwhile (CI clone, 14:09-15:13 on 2026-11-27).
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def find_free_port() -> int:
    """A TCP port free right now on 127.0.0.1 for a server or a master port bound a few seconds later: outside the
    ephemeral range, as launch.sh picks its master port (common/listen.py), so no connection takes it meanwhile."""
    from common.listen import free_port_for_later
    return free_port_for_later()


def subprocess_env(**extra: str) -> dict:
    """Environment for child processes: CPU DeepSpeed, one torch thread each (tests share 2 cores)."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def user_env() -> dict:
    """A user's shell: no PYTHONPATH and no GRPO_USER_DIR (launch.sh sets it from the folder it runs in)."""
    env = subprocess_env()
    for k in ("PYTHONPATH", "GRPO_USER_DIR"):  # common.user_code.USER_DIR_ENV
        env.pop(k, None)
    return env


def run_process_group(cmd: list[str], *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for `launch.sh` (or the `deepspeed` launcher), except
    that a run past `timeout` (or a test interrupted meanwhile) is stopped whole: SIGKILL to the command alone (what
    subprocess.run does) left launch.sh's ref server, worker and ranks (each started with setsid) or the launcher's
    ranks running. Here: SIGTERM to the command's own session (launch.sh's trap then stops every child's group),
    then SIGKILL to what is left of it."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # KILL after TERM too: what is left of its session
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.communicate(timeout=60)  # read on: a full pipe would block launch.sh's cleanup
            except subprocess.TimeoutExpired:
                pass
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch_as_user(folder, mode: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """`launch.sh MODE ARGS...` run from `folder` as a user runs it (user_env)."""
    return run_process_group(["bash", str(REPO / "launch.sh"), mode, *args], cwd=folder, env=user_env(),
                             timeout=timeout)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit code (kill after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


@contextmanager
def start_ref_server(model_dir: str | os.PathLike, *args: str, port: int | None = None,
                     env: dict | None = None, ready_timeout: float = 120.0) -> Iterator[ServerProcess]:
    """Run `python -m ref_server --model DIR --port P ARGS...`, wait for /health, SIGTERM it at the end."""
    port = port or find_free_port()
    fd, log_name = tempfile.mkstemp(prefix="ref_server.", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    with open(log_path, "wb") as log_file:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen([sys.executable, "-m", "ref_server", "--model", str(model_dir), "--port", str(port),
                                 *args], cwd=REPO, env=env or subprocess_env(), stdout=log_file,
                                stderr=subprocess.STDOUT)
    srv = ServerProcess(proc, f"http://127.0.0.1:{port}", port, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ref server exited with {proc.returncode}:\n{srv.log()[-3000:]}")
            try:
                if requests.get(srv.url + "/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"ref server not healthy after {ready_timeout} s:\n{srv.log()[-3000:]}")
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            try:
                srv.stop(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the embedded tiny Qwen2 model (built once, cached)."""
    from common.tiny_model import ensure_tiny_model
    return ensure_tiny_model()


@dataclass
class RankProbes:
    """What tests/rank_probes.py's one launch left: its exit status, its output, and its folder (updates.pt)."""
    returncode: int | None  # None: stopped at the timeout
    out: str  # stdout, then stderr
    stdout: str
    folder: Path


@pytest.fixture(scope="session")
def rank_probes(tiny_model_dir, tmp_path_factory) -> RankProbes:
    """ONE `deepspeed --num_gpus 2` launch of tests/rank_probes.py for the 2-rank probes of test_eval_shard.py,
    test_pack_bound.py and test_zero3_lockstep.py, across the suite's xdist workers too (each runs its files'
    session fixtures on its own): the first to ask runs it under a file lock in the run's shared temporary folder,
    a worker asking meanwhile waits on the lock, and every later one reads what the first left."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/: this run's, every worker's
    folder, result = shared / "rank_probes", shared / "rank_probes" / "result.json"
    with open(shared / "rank_probes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.is_file():
            folder.mkdir(exist_ok=True)
            cmd = [str(REPO / ".venv" / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(find_free_port()),
                   str(REPO / "tests" / "rank_probes.py"), str(tiny_model_dir), str(folder)]
            env = subprocess_env(PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")  # this checkout, the probes
            timeout = 1800  # the three launches' own limits were 600, 800 and 1200 s; past it the ranks are stopped
            try:
                proc = run_process_group(cmd, cwd=REPO, env=env, timeout=timeout)
                done = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            except subprocess.TimeoutExpired as e:  # recorded: the other files fail on it too, without a rerun
                out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
                done = {"returncode": None, "stdout": out, "stderr": f"stopped after {timeout} s"}
            result.write_text(json.dumps(done))
    done = json.loads(result.read_text())
    return RankProbes(done["returncode"], done["stdout"] + done["stderr"], done["stdout"], folder)


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture
def check_in(monkeypatch, capsys):
    """check_in(folder, *args) -> (exit code, stdout, stderr): trainer.check itself, what `launch.sh check` execs, run
    in `folder` with its GRPO_USER_DIR as launch.sh sets it (common/user_code.py). For a check's own line a launch.sh
    start (a torch + transformers import, ~5 CPU-s) adds nothing; keep one launch.sh check per file for its path."""
    def run(folder, *args: str) -> tuple[int, str, str]:
        from trainer.check import main as check
        monkeypatch.chdir(folder)
        monkeypatch.setenv("GRPO_USER_DIR", str(folder))
        code = check([str(a) for a in args])
        got = capsys.readouterr()
        return code, got.out, got.err
    return run


@pytest.fixture
def checks_pass(check_in):
    """checks_pass(folder, *args) -> ["--skip-checks"]: `launch.sh check`'s checks on a run's arguments, here (check_in:
    ~0.3 CPU-s against ~2.6 for a `trainer.check` process), asserted to pass; for a `launch.sh train` of those
    arguments whose subject is not the checks, which then skips them (an explicit option, said in its output)."""
    def run(folder, *args: str) -> list[str]:
        code, out, err = check_in(folder, *args)
        assert code == 0 and "check: all passed" in out, out + err
        return ["--skip-checks"]
    return run


@pytest.fixture(scope="session")
def start_server():
    """The start_ref_server context manager, as a fixture (usable from module-scoped fixtures)."""
    return start_ref_server


def qwen_vocab_dir(request, variant: str, **shape) -> Path:
    """Real-vocabulary Qwen2.5 checkpoint (tests/qwen_vocab.py), cached in pytest's cache dir (not committed)."""
    from qwen_vocab import cached_checkpoint
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider: build in a temp dir then
    root = cache.mkdir("qwen_vocab") if cache is not None else request.getfixturevalue("tmp_path_factory").mktemp("qv")
    return cached_checkpoint(root, variant, **shape)


@pytest.fixture(scope="session")
def qwen_instruct_dir(request) -> Path:
    """Qwen2.5-Instruct-like: real 151,643-rank BPE tokenizer, eos <|im_end|>, pad <|endoftext|>, random body."""
    return qwen_vocab_dir(request, "instruct")


@pytest.fixture(scope="session")
def qwen_base_dir(request) -> Path:
    """Qwen2.5 base-like: the same tokenizer with eos = pad = <|endoftext|>, random body."""
    return qwen_vocab_dir(request, "base")


def pytest_configure(config):
    # registered here, not in pyproject.toml: editing that file changes scripts/setup.sh's stamp (a venv reinstall)
    config.addinivalue_line("markers", "gpu: needs CUDA (tests/test_gpu.py); skipped, with the reason, where there "
                                       "is none (CI)")
    config.addinivalue_line("markers", "multiproc: starts several real processes (deepspeed ranks, a vLLM engine, "
                                       "launch.sh's run) without being an end-to-end `slow` test; in the full "
                                       "suite, left out of ./run_tests.sh --fast")
    config.addinivalue_line("markers", "registry: asks the package registry (network, minutes); skipped unless "
                                       "selected with -m registry, so ./run_tests.sh and CI never run it")
    xdist_filler.configure(config)


def pytest_collection_modifyitems(config, items):
    """End-to-end (slow) files first: with two files at a time (run_tests.sh), the short files then fill
    in at the end instead of one long file running on alone. The sort is stable: order within a file holds.
    `registry` tests are skipped, with the reason, unless the -m expression names them. With --filler-worker, a
    worker lists the files the filler may not run (tests/xdist_filler.py)."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
    xdist_filler.write_heavy_files(config, items)
    if "registry" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="asks the package registry: run with -m registry")
        for item in items:
            if item.get_closest_marker("registry"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def _sys_path_at_start() -> list[str]:
    """sys.path once collection is done (test modules' own imports included), before any fixture ran."""
    return list(sys.path)


@pytest.fixture(autouse=True)
def _sys_path_restored(_sys_path_at_start):
    """sys.path as it was before each test. In-process loads of a user folder (tools, rewards) put that folder on
    the path, as they do in the product's one-run processes; left there it would shadow modules in later tests on
    the same worker, and spawned processes inherit it. A folder of the checkout put there fails the test: bench/
    on the path made `ref_server` bench/ref_server.py for test_nodes.py's spawned ranks (CI, stop 47). Compared
    with the session's start, so a module-scoped fixture that leaves one (set up before this one: CI, stop 50,
    tests/test_gpu_check.py) fails its first test too, and is taken off the path."""
    before = list(sys.path)
    yield
    added = [p for p in sys.path if p not in _sys_path_at_start]
    ours = [p for p in added if Path(p).resolve().is_relative_to(REPO)
            and not Path(p).resolve().is_relative_to(REPO / ".venv")]  # e.g. setuptools' _vendor: not ours
    sys.path[:] = [p for p in before if p not in ours]
    if ours:
        pytest.fail(f"the test or a fixture left {ours} on sys.path: a folder of the checkout shadows the packages; "
                    "use monkeypatch.syspath_prepend (pytest.MonkeyPatch.context() in a module fixture)")


@pytest.fixture(autouse=True)
def _user_modules_dropped(tmp_path_factory):
    """A user's reward or tool module loaded in this process from a test's folder (`my_rewards:short` is imported
    by name, and cached in sys.modules by it, as in the product's one-run processes) is dropped after the test: left
    there, a later test on the same worker asking for its own folder's `my_rewards` got the earlier folder's (CI-like
    run, test_user_code after test_trl_e2e's in-process checks)."""
    yield
    base = tmp_path_factory.getbasetemp()
    folders = tuple({str(base) + os.sep, str(base.resolve()) + os.sep})  # string prefixes: ~5,000 modules a test
    # a copy, not list(sys.modules.items()): a thread the test left running (a server's, a loader's) may import
    # meanwhile, and iterating the live dict then raised "dictionary changed size during iteration" at teardown (an
    # ERROR in tests/test_weight_sync.py, twice); dict.copy() runs without letting another thread in
    for name, mod in sys.modules.copy().items():
        where = getattr(mod, "__file__", None)
        if isinstance(where, str) and where.startswith(folders):
            sys.modules.pop(name, None)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the test modules) lives as long as the session: frozen, every
    later full collection skips it (common/gc_pause.py; ~10 % of the in-process tests' CPU)."""
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()  # the interpreter's last collection sees everything again, as without the freeze
