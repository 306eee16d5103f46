"""A real Slurm on one machine (issue 63's test): munged, a slurmctld and one slurmd per host, each host a network
namespace of tests/netns.py with a UTS name of its own (its hostname is its Slurm node name).

    with SlurmCluster(base, ["n0", "n1"]) as sc:
        sc.run(["sbatch", "--parsable", "job.sbatch"])     # run from the login host ("ctl", also the controller)
        sc.job(job_id)                                     # scontrol show job, as a dict

Every daemon keeps its spool, pid file and log under `base` (base/ctl, base/n0, ...), and its configuration is
base/slurm.conf (SLURM_CONF for the commands); munged listens on a socket under base with a key of its own. The
daemons run in the foreground as children of this process; stop() kills them (and everything left in the
namespaces) and removes the namespaces. Needs root, iproute2, unshare and Debian's slurm-wlm + munge
(scripts/setup.sh --slurm); `missing()` says what is absent.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from netns import Hosts, can_make_namespaces

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "unshare")


def missing() -> str | None:
    """None when a cluster can be made here, else why not."""
    why = can_make_namespaces()
    if why:
        return why
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").is_file()]
    if absent:
        return f"{', '.join(absent)} not installed (bash scripts/setup.sh --slurm installs slurm-wlm and munge)"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """ctl (controller and login host) plus the compute hosts `nodes`, `cpus` CPUs each."""

    def __init__(self, base: Path, nodes: list[str], cpus: int = 2, kill_wait: int = 30) -> None:
        self.base, self.nodes, self.cpus, self.kill_wait = Path(base), list(nodes), cpus, kill_wait
        self.hosts = Hosts(["ctl", *self.nodes], net=214)
        self.conf = self.base / "slurm.conf"
        self.socket = self.base / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    # -- set-up ------------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self, **extra: str) -> dict:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update(extra)
        return env

    def write_conf(self) -> None:
        b, a = self.base, self.hosts.addr
        lines = [
            "ClusterName=grpotest", f"SlurmctldHost=ctl({a['ctl']})", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again (120 s by default)
            f"AuthInfo=socket={self.socket},cred_expire=10",
            f"StateSaveLocation={b}/ctl/state", f"SlurmdSpoolDir={b}/%n/spool",
            f"SlurmctldPidFile={b}/ctl/slurmctld.pid", f"SlurmdPidFile={b}/%n/slurmd.pid",
            f"SlurmctldLogFile={b}/ctl/slurmctld.log", f"SlurmdLogFile={b}/%n/slurmd.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "JobRequeue=1", f"KillWait={self.kill_wait}",
            "MinJobAge=600", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "MessageTimeout=10",
            "SchedulerParameters=sched_interval=1", "GresTypes=gpu",
        ]
        for n in self.nodes:  # one "GPU" each, with no device file: what the step is given (SLURM_GPUS_ON_NODE)
            lines.append(f"NodeName={n} NodeAddr={a[n]} CPUs={self.cpus} Gres=gpu:1 State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # no cgroup plugin is used (proctrack/linuxproc, task/none), but slurmd loads one: its autodetection fails
        # on some sandboxes' /sys/fs/cgroup, so name it
        (self.base / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        (self.base / "gres.conf").write_text("Name=gpu File=/dev/null\n")

    def _daemon(self, host: str, name: str, argv: list[str]) -> None:
        """Run argv in `host`'s namespace under a UTS name of its own (= host), logging to base/host/name.out."""
        inner = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *argv]
        log = open(self.base / host / f"{name}.out", "ab")
        self.procs[f"{host}:{name}"] = subprocess.Popen(self.hosts.cmd(host, inner), stdout=log,
                                                        stderr=subprocess.STDOUT, env=self.env(),
                                                        start_new_session=True)
        log.close()

    def start(self) -> None:
        for d in ("ctl/state", "munge", *(f"{n}/spool" for n in self.nodes)):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.base / "munge", 0o700)
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.hosts.__enter__()
        self.write_conf()
        m = self.base / "munge"
        self.procs["munged"] = subprocess.Popen(
            [_exe("munged"), "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
             f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=open(m / "munged.out", "ab"), start_new_session=True)
        self._wait(lambda: self.socket.exists(), 20, "munged's socket")
        self._daemon("ctl", "slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(n, "slurmd", [_exe("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self.nodes_idle, 60, "every node idle in sinfo")

    def _wait(self, ok, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}:\n{self.logs()}")
            if ok():
                return
            time.sleep(0.5)
        raise TimeoutError(f"no {what} after {timeout:.0f} s:\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        out = []
        for f in sorted(self.base.glob("*/*.log")) + sorted(self.base.glob("*/*.out")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f}\n" + "\n".join(text))
        return "\n".join(out)

    # -- commands -----------------------------------------------------------------------------------
    def run(self, argv: list[str], host: str = "ctl", timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm command (or any argv) on `host`, the login host by default."""
        return subprocess.run(self.hosts.cmd(host, argv), capture_output=True, text=True, timeout=timeout,
                              env=kw.pop("env", None) or self.env(), **kw)

    def nodes_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def job(self, job_id: str) -> dict:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        r = self.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    # -- tear-down ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Every daemon and whatever runs in the namespaces (jobs' processes too), then the namespaces."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.hosts.remove()
