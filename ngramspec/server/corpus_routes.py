"""Corpus management: named external corpora (/v1/corpora) and the learned corpus (/v1/learned).

External corpora load on ExternalCorpora's loader thread and are published atomically, so a load
never stalls generation. Files are read only from under --corpus-dir; the learned corpus may also
be saved to / restored from the operator's --corpus-state path.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ngramspec.server import learned
from ngramspec.server.protocol import (
    ApiError,
    CorpusAddRequest,
    StatePathRequest,
    bad_request,
    parse_json,
    validate,
)
from ngramspec.server.security import corpus_files, resolve_under
from ngramspec.server.state import ServerState

router = APIRouter()


@router.get("/v1/corpora")
async def list_corpora(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    data = [{"object": "corpus", "name": name, "num_tokens": size, "status": "ready"}
            for name, size in sorted(state.corpora.list().items())]
    data += [{"object": "corpus", "name": name, "num_tokens": None, "status": "loading"}
             for name in sorted(state.corpus_loads)]
    data += [{"object": "corpus", "name": name, "num_tokens": None, "status": "failed",
              "error": error} for name, error in sorted(state.corpus_errors.items())]
    return {"object": "list", "data": data, "max_tokens": state.corpora.max_tokens,
            "remaining_tokens": state.corpora.remaining_tokens}


@router.post("/v1/corpora")
async def add_corpus(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    req = validate(CorpusAddRequest, parse_json(await request.body()))
    if (req.documents is None) == (req.path is None):
        raise bad_request("give exactly one of documents (a list of texts) or path "
                          "(relative to --corpus-dir)", "documents")
    if req.name in state.corpora or req.name in state.corpus_loads:
        raise ApiError(409, f"corpus {req.name!r} already exists; delete it first", "name",
                       code="corpus_exists")
    load = asyncio.wrap_future(_start_load(state, req))
    state.corpus_loads[req.name] = load
    state.corpus_errors.pop(req.name, None)
    load.add_done_callback(lambda f: _load_done(state, req.name, f))
    if not req.wait:
        return JSONResponse({"object": "corpus", "name": req.name, "num_tokens": None,
                             "status": "loading"}, status_code=202)
    try:
        size = await asyncio.shield(load)  # a client leaving does not cancel the load
    except ValueError as e:  # CorpusError, CorruptFileError: bad input, nothing published
        raise bad_request(str(e), "path" if req.path else "documents",
                          code="invalid_corpus") from e
    return JSONResponse({"object": "corpus", "name": req.name, "num_tokens": size,
                         "status": "ready"}, status_code=201)


def _start_load(state: ServerState, req: CorpusAddRequest) -> Any:
    corpora, tokenizer = state.corpora, state.corpus_tokenizer
    if req.documents is not None:
        return corpora.add_async(req.name, req.documents, tokenizer)
    files = corpus_files(state.settings.corpus_root, req.path or "")
    if len(files) == 1 and files[0].suffix == ".ngc":
        return corpora.add_built_async(req.name, files[0])
    return corpora.add_files_async(req.name, files, tokenizer)


def _load_done(state: ServerState, name: str, load: asyncio.Future) -> None:
    state.corpus_loads.pop(name, None)
    if not load.cancelled() and load.exception() is not None:
        state.corpus_errors[name] = str(load.exception())


@router.delete("/v1/corpora/{name}")
async def delete_corpus(name: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    if name in state.corpus_loads:
        raise ApiError(409, f"corpus {name!r} is still loading", "name", code="corpus_loading")
    failed = state.corpus_errors.pop(name, None) is not None
    if not state.corpora.remove(name) and not failed:
        raise ApiError(404, f"no corpus named {name!r}", "name", code="not_found")
    return {"object": "corpus", "name": name, "deleted": True}


# ---- the learned corpus ---------------------------------------------------------------------

@router.get("/v1/learned")
async def learned_info(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return {"object": "learned_corpus", **await _on_engine(state, learned.info)}


@router.post("/v1/learned/save")
async def save_learned(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    path = _state_path(state, validate(StatePathRequest, await _json_or_empty(request)), False)
    snapshot = await _on_engine(state, learned.snapshot)
    try:
        size = await asyncio.to_thread(learned.write, path, snapshot)
    except OSError as e:
        raise bad_request(f"cannot write {path.name}: {e.strerror or e}", "path") from e
    return {"object": "learned_corpus", "saved": True, "num_nodes": snapshot[0]["num_nodes"],
            "bytes": size}


@router.post("/v1/learned/restore")
async def restore_learned(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    path = _state_path(state, validate(StatePathRequest, await _json_or_empty(request)), True)
    kind = await _on_engine(state, lambda e: (learned.trie_class(e), learned.max_depth(e)))
    try:
        trie = await asyncio.to_thread(learned.read, path, *kind)
    except ValueError as e:
        raise bad_request(str(e), "path", code="invalid_state_file") from e
    nodes = await _on_engine(state, lambda engine: learned.install(engine, trie))
    return {"object": "learned_corpus", "restored": True, "num_nodes": nodes}


@router.post("/v1/learned/flush")
async def flush_learned(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    await _on_engine(state, learned.flush)
    return {"object": "learned_corpus", "flushed": True}


async def _on_engine(state: ServerState, fn: Any) -> Any:
    try:
        return await state.engine.call(fn)
    except learned.NoLearnedCorpus as e:
        raise bad_request(str(e), code="no_learned_corpus") from e


async def _json_or_empty(request: Request) -> Any:
    body = await request.body()
    return parse_json(body) if body.strip() else {}


def _state_path(state: ServerState, req: StatePathRequest, must_exist: bool) -> Path:
    if req.path is not None:
        return resolve_under(state.settings.corpus_root, req.path, must_exist)
    if state.settings.corpus_state is None:
        raise bad_request("no path given and the server has no --corpus-state", "path")
    path = Path(state.settings.corpus_state)
    if must_exist and not path.is_file():
        raise ApiError(404, f"{path} does not exist yet (nothing saved)", "path",
                       code="not_found")
    return path
