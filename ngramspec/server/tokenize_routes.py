"""vLLM's POST /tokenize and /detokenize, with vLLM's request and response shapes.

    /tokenize    {"prompt": "..."} or {"messages": [...], "add_generation_prompt": true}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [...]} -> {"prompt": "..."}

The chat form takes the chat request's template fields (tools, chat_template_kwargs,
add_generation_prompt, continue_final_message, add_special_tokens) and renders the messages with
/v1/chat/completions' own `chat_prompt`, so its ids are that request's prompt. Both go through the encoder
thread: a long text takes a while either way.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ngramspec.server.completions import chat_prompt, check_model
from ngramspec.server.protocol import (
    ChatCompletionRequest,
    _Strict,
    bad_request,
    parse_json,
    validate,
)
from ngramspec.server.state import ServerState

router = APIRouter()


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # vLLM's default for a plain prompt
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """A chat request's prompt fields (its sampling fields are accepted and unused)."""

    model: str | None = None  # type: ignore[assignment]  # optional here, as in vLLM
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    body = parse_json(await request.body())
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise bad_request("send either prompt or messages, not both", "prompt")
        chat = validate(TokenizeChatRequest, body)
        _check_model(state, chat.model)
        ids, _, _ = await chat_prompt(state, chat)
        strs = chat.return_token_strs
    else:
        req = validate(TokenizeCompletionRequest, body)
        _check_model(state, req.model)
        ids = await state.encoder.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = req.return_token_strs
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if strs else None}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    req = validate(DetokenizeRequest, parse_json(await request.body()))
    _check_model(state, req.model)
    if any(not 0 <= t < state.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {state.vocab_size})", "tokens")
    return {"prompt": await state.encoder.decode(req.tokens)}


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None:  # optional here, as in vLLM
        check_model(state, model)
