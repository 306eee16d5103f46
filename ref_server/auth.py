"""Who may call: the bearer token check (constant time, on the raw header bytes) that the app and the request
gate (ref_server/gate.py) share, and the ?token= query form the status views also take.
"""
from __future__ import annotations

import hmac
from urllib.parse import parse_qs


def _authorized(token: str | None, environ: dict) -> bool:
    if token is None:
        return True
    # The raw WSGI value (a latin-1 str per PEP 3333): bottle's get_header() would try to
    # UTF-8-decode it and raise on arbitrary client bytes.
    scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    # compare_digest on the bytes as sent: constant time, no TypeError on non-ASCII input
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), token.encode())


def _query_token_ok(token: str | None, environ: dict) -> bool:
    """?token= on the status views only: a browser cannot send a bearer header."""
    given = (parse_qs(environ.get("QUERY_STRING", "")).get("token") or [""])[0]
    return token is not None and bool(given) and hmac.compare_digest(given.encode("latin-1", "replace"),
                                                                     token.encode())
