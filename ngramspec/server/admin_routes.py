"""Admin routes with SGLang's names: POST /update_weights_from_disk (new weights in place, for RL
rollouts between policy updates) and POST /flush_cache (empty the prefix cache)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from ngramspec.engine.engine import LLMEngine
from ngramspec.server.protocol import _Strict, bad_request, parse_json, validate
from ngramspec.server.state import ServerState

router = APIRouter()


class UpdateWeightsRequest(_Strict):
    model_path: str = Field(min_length=1)  # a GGUF file or an HF directory, same architecture


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    """Loads on the engine thread between steps: requests in flight keep their tokens, are
    recomputed under the new weights and go on (LLMEngine.update_weights)."""
    state: ServerState = request.app.state.server
    req = validate(UpdateWeightsRequest, parse_json(await request.body()))
    try:
        await state.engine.call(lambda engine: engine.update_weights(req.model_path))
    except ValueError as e:  # missing path, another architecture, shapes that do not fit
        raise bad_request(str(e), "model_path", code="invalid_weights") from e
    return {"success": True, "message": f"loaded {req.model_path}"}


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server

    def flush(engine: LLMEngine) -> int:
        return engine.scheduler.flush_cache()

    freed = await state.engine.call(flush)
    return {"success": True, "freed_slots": freed}
