"""The ref server's heartbeat table and the status view built on it (GET /status JSON, GET / HTML).

Every producer (genonly worker, trainer rank generating its own rollouts) and consumer (trainer rank)
names itself in request headers (common/wire/client.py sends them):

    X-GRPO-Id: worker0        X-GRPO-Role: worker | rank        X-GRPO-Host: node-a
    X-GRPO-Version: 12        (the policy version it is on)

/upload, /get and POST /heartbeat update its row; a participant silent for longer than `stall_warn`
seconds is listed in `stalled`. Participants that said they are done (heartbeat state "done") are
never stalled.
"""
from __future__ import annotations

import html
import threading
import time

from common.placement.plan import describe as describe_placement

MAX_PARTICIPANTS = 1000  # the table is bounded: identities come from clients
# cumulative totals a client reports in its heartbeat; the tool_* ones (and completions) from tool runs,
# agent_faults from agent runs (rollouts whose agent failed: reward None)
_COUNTS = ("skipped_groups", "dropped_stale", "rounds", "completions", "tool_calls", "tool_failed", "tool_timed_out",
           "tool_malformed", "all_steps", "agent_faults")  # all_steps: a rank's run length (trainer_state.max_steps)


def _clean(value: object, limit: int = 80) -> str:
    """A client-supplied header value made safe to store and show: printable ASCII, bounded."""
    return "".join(c for c in str(value) if 32 <= ord(c) < 127)[:limit]


def identity_from_environ(environ: dict) -> dict | None:
    """The participant's identity from the WSGI environ, or None when the request carries none."""
    pid = _clean(environ.get("HTTP_X_GRPO_ID", ""))
    if not pid:
        return None
    version = _clean(environ.get("HTTP_X_GRPO_VERSION", ""), 20)
    return {"id": pid, "role": _clean(environ.get("HTTP_X_GRPO_ROLE", "")) or "unknown",
            "host": _clean(environ.get("HTTP_X_GRPO_HOST", "")),
            "addr": _clean(environ.get("REMOTE_ADDR", ""), 64),  # where it calls from, as this server sees it
            "version": int(version) if version.isdigit() else None}


class HeartbeatTable:
    """Thread-safe table: participant id -> its last activity and counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, dict] = {}

    def _row(self, ident: dict, now: float) -> dict | None:  # under the lock
        row = self._rows.get(ident["id"])
        if row is None:
            if len(self._rows) >= MAX_PARTICIPANTS:
                return None
            row = self._rows[ident["id"]] = {
                "id": ident["id"], "first_seen": now, "last_upload": None, "last_get": None,
                "last_heartbeat": None, "uploaded": 0, "taken": 0, "state": "", "version": None,
                **{k: 0 for k in _COUNTS}}
        row["role"], row["host"], row["last_seen"] = ident["role"], ident["host"], now
        row["addr"] = ident.get("addr", "")
        if ident.get("version") is not None:
            row["version"] = ident["version"]
        return row

    def on_upload(self, ident: dict | None) -> None:
        self._count(ident, "last_upload", "uploaded", 1)

    def on_get(self, ident: dict | None, taken: bool) -> None:
        self._count(ident, "last_get", "taken", int(taken))

    def _count(self, ident: dict | None, when: str, counter: str, n: int) -> None:
        """Stamp `when` and add n to `counter` in the caller's row (anonymous calls are not tracked)."""
        if ident is None:
            return
        with self._lock:
            now = time.time()
            row = self._row(ident, now)
            if row is not None:
                row[when] = now
                row[counter] += n

    def on_heartbeat(self, ident: dict, body: dict) -> None:
        """A heartbeat: the participant is alive; `body` may carry state and cumulative counters."""
        with self._lock:
            now = time.time()
            row = self._row(ident, now)
            if row is None:
                return
            row["last_heartbeat"] = now
            if "state" in body:
                row["state"] = _clean(body["state"], 120)
            for k in _COUNTS:
                v = body.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    row[k] = v

    def snapshot(self, stall_warn: float) -> tuple[list[dict], list[dict]]:
        """(participants sorted by id with `silent_s`, the stalled ones: silent > stall_warn and not done)."""
        now = time.time()
        with self._lock:
            rows = [dict(r) for r in self._rows.values()]
        for r in rows:
            r["silent_s"] = round(now - r["last_seen"], 1)
            for k in ("first_seen", "last_seen", "last_upload", "last_get", "last_heartbeat"):
                r[k + "_ago_s"] = None if r[k] is None else round(now - r[k], 1)
                del r[k]
        rows.sort(key=lambda r: (r["role"], r["id"]))
        stalled = [{"id": r["id"], "role": r["role"], "host": r["host"], "addr": r.get("addr", ""),
                    "silent_s": r["silent_s"]}
                   for r in rows if r["silent_s"] > stall_warn and r["state"] != "done"]
        return rows, stalled


def by_host(participants: list[dict]) -> list[dict]:
    """The participants grouped by the address they call from: which ranks and workers each host runs."""
    hosts: dict[str, dict] = {}
    for r in participants:
        h = hosts.setdefault(r.get("addr") or r["host"], {"addr": r.get("addr", ""), "host": r["host"],
                                                          "ranks": [], "producers": []})
        h["ranks" if r["role"] == "rank" else "producers"].append(r["id"])
    return sorted(hosts.values(), key=lambda h: (h["addr"], h["host"]))


# ----------------------------------------------------------------------------------- views
def _ago(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} s"


def _tools_cell(r: dict) -> str:
    if not r.get("completions"):
        return "-"
    return (f"{r['tool_calls']} ({r['tool_calls'] / r['completions']:.2f}; {r.get('tool_failed', 0)}/"
            f"{r.get('tool_timed_out', 0)}/{r.get('tool_malformed', 0)})")


def format_table(status: dict) -> str:
    """The status as plain text (the terminal view of `./launch.sh status`, and the HTML page's table)."""
    lines = []
    w = status.get("weights", {})
    limit = f", weights up to {w['max_weights_mb']:,.0f} MiB" if w.get("max_weights_mb") is not None else ""
    lines.append(f"ref server up {status.get('uptime_s', 0):.0f} s, policy version {w.get('version')} "
                 f"(published {_ago(w.get('age_s'))} ago{limit}), stall_warn {status.get('stall_warn')} s")
    q = status.get("queues", {})
    lines.append("queues: " + ", ".join(f"{name} {v['depth']} (oldest {_ago(v['oldest_age_s'])})"
                                        for name, v in q.items() if isinstance(v, dict))
                 + (", scoring now" if q.get("scoring") else ""))
    rf = status.get("ref_forward", {})
    if rf.get("batches_ref_skipped"):  # beta = 0 producers: no reference forward for their batches
        lines.append(f"reference forward skipped for {rf['batches_ref_skipped']} of {rf['batches_scored']} batches "
                     f"(needs_ref false: beta = 0)")
    cols = ("id", "role", "addr", "host", "version", "silent_s", "last_upload_ago_s", "last_get_ago_s", "uploaded",
            "taken", "skipped_groups", "dropped_stale", "state")
    heads = ("id", "role", "address", "host", "ver", "silent", "last upload", "last get", "uploaded", "taken",
             "no spread", "stale dropped", "state")
    if any(r.get("tool_calls") for r in status.get("participants", [])):  # a tool run: calls and failures
        cols, heads = cols[:-1] + ("tools",), heads[:-1] + ("tool calls (per c.; fail/timeout/bad)",)
        cols, heads = cols + ("state",), heads + ("state",)
    cells = [list(heads)]
    stalled = {s["id"] for s in status.get("stalled", [])}
    for r in status.get("participants", []):
        row = []
        for c in cols:
            v = _tools_cell(r) if c == "tools" else r.get(c)
            row.append(_ago(v) if c.endswith("_s") else ("-" if v is None or v == "" else str(v)))
        row[0] = ("! " if r["id"] in stalled else "  ") + row[0]
        cells.append(row)
    cells[0][0] = "  " + cells[0][0]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines += ["  ".join(v.ljust(widths[i]) for i, v in enumerate(row)).rstrip() for row in cells]
    if len(cells) == 1:
        lines.append("  (no participant has called in yet)")
    if status.get("placement"):
        lines.append(describe_placement(status["placement"]))
    lines.append("stalled: " + (", ".join(f"{s['id']} ({s['silent_s']:.0f} s silent)"
                                          for s in status.get("stalled", [])) or "none"))
    flat = [r["id"] for r in status.get("participants", []) if str(r.get("state", "")).startswith("nothing to train")]
    if flat:  # alive and busy, so not stalled, yet no group trains (trainer/run/stall.py state())
        lines.append(f"not training: {', '.join(flat)}: every group sampled lately had equal rewards (no spread; "
                     f"its state says how many); train_zero_spread true trains them (TRL's behaviour)")
    return "\n".join(lines)


def render_html(status: dict, refresh_s: int = 5) -> str:
    """A small self-refreshing page (meta refresh, no JavaScript): the same table as the terminal view."""
    stalled = status.get("stalled", [])
    banner = (f'<p class="bad">STALLED: {html.escape(", ".join(s["id"] for s in stalled))}</p>' if stalled
              else '<p class="ok">no participant stalled</p>')
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{int(refresh_s)}">
<title>GRPO run status</title>
<style>body{{font-family:sans-serif;margin:1.5em}} pre{{background:#f4f4f4;padding:1em;font-size:14px}}
.bad{{color:#b00;font-weight:bold}} .ok{{color:#070}}</style></head>
<body><h2>GRPO run status</h2>
{banner}
<pre>{html.escape(format_table(status))}</pre>
<p><small>refreshes every {int(refresh_s)} s &middot; JSON: /status</small></p>
</body></html>
"""
