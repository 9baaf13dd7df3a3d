"""The OpenAPI document (/openapi.json, /docs) with the request bodies the routes really take.

The routes parse their JSON by hand (`protocol.validate`) to answer OpenAI-style 400s rather
than FastAPI's 422s, so FastAPI sees no body model. Here each route's pydantic model is published
as its request body; the models' shared definitions go to `components/schemas`, where the
`$ref`s point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ngramspec.server.admin_routes import UpdateWeightsRequest
from ngramspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CorpusAddRequest,
    StatePathRequest,
)
from ngramspec.server.tokenize_routes import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

REF_TEMPLATE = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class Body:
    models: tuple[type[BaseModel], ...]  # several: any one of them (anyOf)
    required: bool = True


REQUEST_BODIES: dict[tuple[str, str], Body] = {
    ("post", "/v1/completions"): Body((CompletionRequest,)),
    ("post", "/v1/chat/completions"): Body((ChatCompletionRequest,)),
    ("post", "/tokenize"): Body((TokenizeCompletionRequest, TokenizeChatRequest)),
    ("post", "/detokenize"): Body((DetokenizeRequest,)),
    ("post", "/v1/corpora"): Body((CorpusAddRequest,)),
    ("post", "/v1/learned/save"): Body((StatePathRequest,), required=False),
    ("post", "/v1/learned/restore"): Body((StatePathRequest,), required=False),
    ("post", "/update_weights_from_disk"): Body((UpdateWeightsRequest,)),
}


def install(app: FastAPI) -> None:
    """Replace `app.openapi` (what /openapi.json serves) with the document plus bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            add_request_bodies(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_request_bodies(schema: dict[str, Any],
                       bodies: dict[tuple[str, str], Body] | None = None) -> None:
    bodies = REQUEST_BODIES if bodies is None else bodies
    models = sorted({m for body in bodies.values() for m in body.models}, key=_name)
    refs, defs = models_json_schema([(m, "validation") for m in models],
                                    ref_template=REF_TEMPLATE)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    for (method, path), body in bodies.items():
        operation = schema.get("paths", {}).get(path, {}).get(method)
        if operation is None:  # the route is not mounted
            continue
        options = [refs[(m, "validation")] for m in body.models]
        operation["requestBody"] = {
            "required": body.required,
            "content": {"application/json": {
                "schema": options[0] if len(options) == 1 else {"anyOf": options}}}}


def _name(model: type[BaseModel]) -> str:
    return model.__name__
