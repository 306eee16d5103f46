"""Nothing waits forever: heartbeats to the ref server, and a watchdog on each trainer rank.

Heartbeat (ranks and genonly workers): a daemon thread that tells the ref server every `heartbeat_s`
seconds what this process is doing, so GET /status shows it alive while it generates a long round or
trains a long step. A process that is stopped (SIGSTOP) or gone falls silent and is listed as stalled.

Watchdog (ranks): a daemon thread that
- ends the rank (exit 3) when no optimizer step came for `stall_timeout` seconds, with a diagnosis:
  what the rank was waiting for, the server's `stalled` list (or that the server does not answer),
  and the last lines of a stalled participant's log where it is local (RUN_DIR/<id>.log);
- ends the rank (exit 4) as soon as a peer rank on this host is gone, naming it (torch's gloo would
  otherwise wait up to `dist_timeout` in the next collective);
- on rank 0, logs participants that become stalled or come back (from GET /status);
- takes over SIGTERM: when one rank dies, the deepspeed launcher TERMs the others at its next poll,
  which under load can beat the 0.25 s peer check. A TERM is therefore first checked for a dead peer
  (named, exit 4), else the rank exits 143 as before.
The one-line diagnosis also goes to OUTPUT_DIR/diagnosis.txt (first writer wins), which launch.sh
repeats as its last line.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

from common.wire.client import RefServerError

log = logging.getLogger("trainer")
EXIT_STALLED, EXIT_PEER_GONE, EXIT_UNUSABLE_BATCHES = 3, 4, 5  # 5: trainer/batches.py UnusableBatches
EXIT_WEIGHTS_REFUSED = 6  # WeightsRefused


class WeightsRefused(RuntimeError):
    """The ref server refused the published policy weights for good (413: over its max_weights_mb), so no
    worker can follow the policy: ends the run (trainer/loop.py: exit 6) with this one line."""


def write_diagnosis(out_dir: str | Path, line: str) -> None:
    """Record the run's first failure diagnosis (one line) for launch.sh; later ones only go to the logs."""
    try:
        with open(Path(out_dir) / "diagnosis.txt", "x") as f:
            f.write(line.replace("\n", " ") + "\n")
    except FileExistsError:
        pass


def tail(path: Path, lines: int = 5) -> list[str]:
    """Last lines of a (possibly large) log file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 8192))
        return [x.decode(errors="replace") for x in deque(f.read().splitlines(), maxlen=lines)]


class Heartbeat:
    """Background heartbeats: `state()` -> str and `counts()` -> dict of cumulative ints, every `every` s."""

    def __init__(self, client, every: float, state, counts=lambda: {}) -> None:
        self.client, self.every, self.state, self.counts = client, every, state, counts
        self._stop = threading.Event()
        self._failing = False
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def beat(self, state: str | None = None) -> None:
        try:
            self.client.heartbeat(state or self.state(), **self.counts())
            if self._failing:
                log.info("heartbeats reach the ref server again")
            self._failing = False
        except RefServerError as e:  # the server is down or busy: the watchdog / client retries handle that
            if not self._failing:
                log.warning("heartbeat not delivered (%s); will keep trying", e)
            self._failing = True

    def _run(self) -> None:
        # the first beat at once: a rank is in the status table as soon as it is up, and a worker sharing its GPU
        # waits for that (trainer/worker.py wait_for_ranks)
        self.beat()
        while not self._stop.wait(self.every):
            self.beat()

    def stop(self, final_state: str = "done") -> None:
        """Stop beating and tell the server we are done (so GET /status does not list us as stalled)."""
        self._stop.set()
        self.beat(final_state)


class Watchdog:
    """Per-rank stall and peer-death detector (see the module doc). `activity` says what the rank is doing."""

    def __init__(self, cfg, client, rank: int, peers: list[tuple[str, int]], poll: float = 0.25) -> None:
        self.cfg, self.client, self.rank, self.peers = cfg, client, rank, peers  # peers[r] = (host, pid)
        self.activity = "starting"
        self.last_step = time.monotonic()
        self.poll = poll
        self._stop = threading.Event()
        self._flagged: set[str] = set()
        self._next_status = 0.0
        self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._term_fd: int | None = None

    def start(self) -> Watchdog:
        self._catch_sigterm()
        self.thread.start()
        return self

    def _catch_sigterm(self) -> None:
        """SIGTERM becomes a byte on a pipe that this thread reads (set_wakeup_fd writes it from the C
        handler, even while the main thread is blocked in a collective, where a Python handler never runs)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. not in some tests)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.signal(signal.SIGTERM, lambda *_: None)  # the real handling is _sigterm_seen in the thread
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._term_fd = r

    def _wait(self) -> bool:
        """Sleep one poll period, waking at once on a SIGTERM; True once stop() was called."""
        if self._term_fd is None:
            return self._stop.wait(self.poll)
        select.select([self._term_fd], [], [], self.poll)
        return self._stop.is_set()

    def _sigterm_seen(self) -> bool:
        try:
            data = os.read(self._term_fd, 64)
        except BlockingIOError:
            return False
        return signal.SIGTERM in data  # other signals with a Python handler (SIGINT) write their byte too

    def stepped(self) -> None:
        self.last_step = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()
        if self._term_fd is not None:  # SIGTERM kills the rank again, as without a watchdog
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            term, self._term_fd = self._sigterm_seen(), None
            if term:  # arrived after the thread's last look
                self._exit_on_sigterm(linger=0.0)

    # -- checks ------------------------------------------------------------------------------
    def dead_peers(self) -> list[str]:
        """Peer ranks on this host whose process is gone."""
        me = self.peers[self.rank][0]
        dead = []
        for r, (host, pid) in enumerate(self.peers):
            if r != self.rank and host == me and not _alive(pid):
                dead.append(f"rank {r} (pid {pid} on {host})")
        return dead

    def peer_diagnosis(self, error: BaseException | None = None, grace: float = 0.0) -> str:
        """One line naming the dead peer rank(s); `grace`: seconds to keep looking for one. A SIGKILLed peer's
        sockets close while its process is still exiting (not yet a zombie), so the collective's error can
        come a moment before the peer looks gone."""
        dead = self.dead_peers()
        deadline = time.monotonic() + grace
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_peers()
        me = self.peers[self.rank][0]
        elsewhere = sorted({h for h, _ in self.peers if h != me})
        if dead:
            who = ", ".join(dead) + " is gone"
        elif elsewhere:  # nothing local died: the host(s) we cannot look into are the suspects
            ranks = "; ".join(f"{h}: rank {', '.join(str(r) for r, (x, _) in enumerate(self.peers) if x == h)}"
                              for h in elsewhere)
            who = f"a peer rank stopped answering (none on this host is gone; other hosts: {ranks})"
        else:
            who = "a peer rank (not on this host, or stuck) stopped answering"
        tail_ = f": {type(error).__name__}: {str(error)[:300]}" if error is not None else ""
        return f"rank {self.rank}: {who} while this rank was {self.activity}{tail_}"

    def stall_diagnosis(self, silent: float) -> tuple[str, list[str]]:
        """(one-line diagnosis, detail lines) for a rank with no optimizer step for `silent` seconds."""
        head = (f"rank {self.rank}: no optimizer step for {silent:.0f} s (stall_timeout {self.cfg.stall_timeout:g} s)"
                f" while {self.activity}")
        url = self.client.urls[0]
        try:
            status = self.client.status(stall_warn=self.cfg.stall_warn, timeout=min(5.0, self.cfg.ref_timeout))
        except RefServerError as e:
            return f"{head}; the ref server {url} does not answer ({e.message[:200]})", []
        stalled = status.get("stalled", [])
        if not stalled:
            return f"{head}; the ref server {url} answers and lists nobody as stalled", []
        names = ", ".join(f"{s['id']} ({s['silent_s']:.0f} s silent)" for s in stalled)
        details = []
        for s in stalled:
            path = Path(self.cfg.output_dir) / f"{s['id']}.log"
            if path.is_file():
                details.append(f"last lines of {path}:")
                details += ["    " + x for x in tail(path)]
        return f"{head}; stalled at the ref server {url}: {names}", details

    def _die(self, code: int, line: str, details: list[str] = ()) -> None:
        log.error("%s", line)
        for d in details:
            log.error("%s", d)
        write_diagnosis(self.cfg.output_dir, line)
        self._flush()
        os._exit(code)  # from this thread: the main thread may be blocked in a socket or a collective

    def _exit_on_sigterm(self, linger: float) -> None:
        self._flush()
        time.sleep(linger)
        os._exit(128 + signal.SIGTERM)

    @staticmethod
    def _flush() -> None:
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()

    def _watch_status(self) -> None:
        """Rank 0: log participants that become stalled, and those that come back."""
        try:
            stalled = {s["id"]: s for s in self.client.status(stall_warn=self.cfg.stall_warn,
                                                               timeout=5.0)["stalled"]}
        except RefServerError:
            return  # the client's own retries and the stall timeout deal with an absent server
        for pid in sorted(set(stalled) - self._flagged):
            log.warning("participant %s is stalled: silent for %.0f s at the ref server (stall_warn %g s)",
                        pid, stalled[pid]["silent_s"], self.cfg.stall_warn)
        for pid in sorted(self._flagged - set(stalled)):
            log.info("participant %s is back", pid)
        self._flagged = set(stalled)

    def _run(self) -> None:
        while not self._wait():
            term = self._term_fd is not None and self._sigterm_seen()
            dead = self.dead_peers()
            if dead:
                self._die(EXIT_PEER_GONE, self.peer_diagnosis())
            if term:
                # A peer dead before our TERM was named above. Peers TERMed with us (Ctrl-C) check at once
                # too: stay alive a moment so that none of them mistakes our exit for a death.
                log.info("SIGTERM: rank %d stops", self.rank)
                self._exit_on_sigterm(linger=0.5)
            silent = time.monotonic() - self.last_step
            if self.cfg.stall_timeout and silent > self.cfg.stall_timeout:
                self._die(EXIT_STALLED, *self.stall_diagnosis(silent))
            if self.rank == 0 and time.monotonic() >= self._next_status:
                self._next_status = time.monotonic() + self.cfg.heartbeat_s
                self._watch_status()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    # a zombie (exited, not yet reaped by the launcher) is gone too
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
