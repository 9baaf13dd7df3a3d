"""Hardening: API-key check, request-body limit (both plain ASGI middleware) and path confinement
for anything a route reads or writes."""

from __future__ import annotations

import glob
import hmac
import json
from pathlib import Path
from typing import Any

from ngramspec.corpus.readers import expand_paths
from ngramspec.server.protocol import ApiError

Scope = dict[str, Any]


async def send_error(send: Any, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class ApiKeyMiddleware:
    """Every route but OPEN_PATHS (/health, /metrics, the API docs) needs
    `Authorization: Bearer <key>`: the /v1 API, /tokenize, the admin routes such as
    /update_weights_from_disk."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
            given = _header(scope, b"authorization") or b""
            # compare_digest: the time taken does not reveal how much of the key matched.
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or incorrect API key (send 'Authorization: "
                                 "Bearer <key>')", type="invalid_request_error",
                                 code="invalid_api_key")
                await send_error(send, error)
                return
        await self.app(scope, receive, send)


# Probes and scrapers carry no key; nor does a browser fetching the API docs (the schema says
# nothing the code does not).
OPEN_PATHS = ("/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class BodyLimitMiddleware:
    """Refuse (413) a body over `max_bytes`, whether announced by Content-Length or streamed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await send_error(send, self._too_large())
            return
        messages, size = [], 0
        while True:  # buffer the body (routes read it whole anyway) so it can be counted
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await send_error(send, self._too_large())
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.max_bytes} bytes "
                        "(see --max-body-bytes)", code="request_too_large")


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()  # after the body: wait for http.disconnect

    return replayed


# ---- paths ----------------------------------------------------------------------------------

def resolve_under(root: Path | None, relative: str, must_exist: bool = True) -> Path:
    """`relative` inside `root`, symlinks resolved; 403 for anything that lands outside it.

    Resolving first and comparing after catches `..`, absolute paths and symlinks that point
    out of the directory alike.
    """
    if root is None:
        raise ApiError(403, "reading or writing files needs the server to run with --corpus-dir",
                       "path", type="permission_error", code="no_corpus_dir")
    if not relative or "\x00" in relative or glob.has_magic(relative):
        raise ApiError(400, "path must be a plain relative path (no patterns)", "path")
    base = root.resolve()
    target = (base / relative).resolve()
    if not target.is_relative_to(base):
        raise ApiError(403, f"path {relative!r} is outside --corpus-dir", "path",
                       type="permission_error", code="path_outside_corpus_dir")
    if must_exist and not target.exists():
        raise ApiError(404, f"path {relative!r} does not exist under --corpus-dir", "path",
                       code="not_found")
    return target


def corpus_files(root: Path | None, relative: str) -> list[Path]:
    """The files a corpus path names (a directory is searched recursively), each confined to
    `root`; one escaping file (a symlink inside the directory) refuses the whole request."""
    target = resolve_under(root, relative)
    assert root is not None
    files = expand_paths([target]) if target.is_dir() else [target]
    base = root.resolve()
    resolved = [f.resolve() for f in files]
    for original, real in zip(files, resolved):
        if not real.is_relative_to(base):
            raise ApiError(403, f"{original.name!r} links outside --corpus-dir", "path",
                           type="permission_error", code="path_outside_corpus_dir")
    if not resolved:
        raise ApiError(400, f"path {relative!r} holds no files", "path")
    return resolved
