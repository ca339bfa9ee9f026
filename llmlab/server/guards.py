"""Who may use the server: the API key, the Host header, and JSON-only bodies.

Without an API key (the default on a laptop), anything that can reach the port can use
the model, and that includes web pages open in the user's browser:

* A page on another site may send a "simple" cross-site POST (Content-Type `text/plain`,
  form encodings) without asking the server first. Accepting only `application/json`
  (415 otherwise) forces the browser to ask first (a CORS preflight), which this server
  never grants.
* DNS rebinding makes `evil.example` resolve to 127.0.0.1, so the page's requests are
  same-origin and need no preflight; but their Host header still says `evil.example`.
  `allowed_hosts` refuses those (Jupyter checks the Host of local connections the same way).

Each refusal is OpenAI's JSON error object, like every other error.
"""
from __future__ import annotations

import secrets

from starlette.requests import Request    # = fastapi.Request; FastAPI finds it by this name

from llmlab.server.protocol import APIError

LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1"]


def check_api_key_value(api_key: str | None) -> str | None:
    """An empty key would turn auth "on" and let `Authorization: Bearer` (no key) in: refuse it."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty (is LLMLAB_API_KEY set to ''?): give a real key, "
                         "or unset it to serve without one")
    return api_key


def api_key_checker(api_key: str | None):
    """A FastAPI dependency: `Authorization: Bearer <api_key>` or a 401 (no-op without a key)."""
    check_api_key_value(api_key)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of the key was right
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return check_api_key


def host_checker(allowed_hosts: list[str] | None):
    """A FastAPI dependency: the Host header names one of `allowed_hosts` ("*" or None =
    any; "*.example.com" = any subdomain), or a 400. Starlette's TrustedHostMiddleware does
    the same match but answers in plain text; this keeps the OpenAI error format."""
    patterns = None if allowed_hosts is None or "*" in allowed_hosts else [h.lower().strip("[]") for h in allowed_hosts]

    async def check_host(request: Request) -> None:
        if patterns is None:
            return
        host = (request.url.hostname or "").lower()    # without the port; IPv6 without brackets
        if not any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in patterns):
            raise APIError(400, f"the Host header {request.headers.get('host', '')!r} is not an allowed host "
                           f"of this server (--allowed-hosts)", code="invalid_host")
    return check_host


async def require_json(request: Request) -> None:
    """A FastAPI dependency for POST routes: the body must be declared as JSON, and not be
    compressed (RFC 9110 §15.5.16: 415 for a content coding the server does not read)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"send the body as JSON with 'Content-Type: application/json' "
                       f"(got {media_type or 'no Content-Type'!r})", code="unsupported_media_type")
    encodings = [e.strip().lower() for e in request.headers.get("content-encoding", "").split(",")]
    compressed = [e for e in encodings if e not in ("", "identity")]
    if compressed:
        raise APIError(415, f"the body is compressed ('Content-Encoding: {', '.join(compressed)}'); this "
                       f"server reads only uncompressed JSON", code="unsupported_media_type")
