"""POST /v1/completions and /v1/chat/completions, streamed (SSE) or not."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ngramspec.server.async_engine import EngineStopped, RequestStream, SpecStats, TokenEvent
from ngramspec.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from ngramspec.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    check_token_ids,
    parse_json,
    sampling_params,
    validate,
)
from ngramspec.server.state import ServerState
from ngramspec.server.text import TextAssembler
from ngramspec.server.tool_calls import (
    ChatTools,
    ToolCall,
    ToolCallParser,
    chat_tools,
    render_messages,
    select_format,
    template_knows_tools,
)
from ngramspec.structured.grammar import GrammarError
from ngramspec.structured.params import StructuredOutputsParams

router = APIRouter()


@dataclass(slots=True)
class Generation:
    """One admitted request and what its response needs."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    created: int
    num_prompt_tokens: int
    stream: RequestStream
    text: TextAssembler
    include_usage: bool
    arrival: float
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_top_logprobs: int | None = None  # None: the request asked for no logprobs
    token_text: TokenText | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token so far
    text_offset: int = 0  # characters of completion text already streamed (text_offset)
    echo: str | None = None  # completions' echo: the prompt's text, returned first
    echo_first_id: int | None = None  # ... and its first token (listed without a logprob)
    prompt_logprobs: list = field(default_factory=list)  # echo's prompt tokens 1..
    tools: ToolCallParser | None = None  # chat with tools: splits the text into content + calls
    tool_mode: str = "none"  # "auto", "required", "named" or "none"
    index: int = 0  # the choice this generation answers (prompts x n, in OpenAI's order)
    prompt_index: int = 0  # which of the request's prompts it continues
    spec: SpecStats | None = None  # its speculation counters, once finished

    def logprobs_body(self, entries: list, prompt: list | None = None) -> dict[str, Any] | None:
        """`prompt`: echo's prompt-token entries, listed before `entries` (the first response
        chunk or body)."""
        if self.num_top_logprobs is None:
            return None
        assert self.token_text is not None
        if self.kind == "chat":
            return chat_logprobs(entries, self.token_text)
        first = self.echo_first_id if prompt is not None else None
        body = completion_logprobs((prompt or []) + entries, self.token_text,
                                   self.num_top_logprobs, self.text_offset, first)
        self.text_offset += sum(len(t) for t in body["tokens"])
        return body


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = request.app.state.server
    req = validate(CompletionRequest, parse_json(await request.body()))
    check_model(state, req.model)
    items = prompt_items(req.prompt)
    if len(items) > state.settings.max_in_flight:
        raise bad_request(f"at most {state.settings.max_in_flight} prompts per request (got "
                          f"{len(items)})", "prompt")
    prompts = [await _completion_prompt(state, item, i if len(items) > 1 else None,
                                        req.add_special_tokens)
               for i, item in enumerate(items)]
    return await _respond(request, state, req, prompts, "completion", arrival,
                          state.settings.completion_default_max_tokens)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = request.app.state.server
    req = validate(ChatCompletionRequest, parse_json(await request.body()))
    check_model(state, req.model)
    mode = req.tool_mode
    prompt_ids, fmt, tools = await chat_prompt(state, req)
    setup = chat_tools(fmt, tools, state.tokenizer) if tools else None
    structured = req.structured()
    if mode in ("required", "named"):
        if structured is not None:
            raise bad_request(f"tool_choice {mode!r} already constrains the output; drop "
                              "response_format / structured_outputs", "tool_choice")
        name = req.tool_choice.function.name if mode == "named" else None
        assert setup is not None and tools  # tool_mode is "none" without tools
        structured = StructuredOutputsParams(
            grammar=setup.grammar(tools, name, req.parallel_tool_calls))
    return await _respond(request, state, req, [prompt_ids], "chat", arrival, None, structured,
                          mode, setup)


async def chat_prompt(state: ServerState, req: ChatCompletionRequest
                      ) -> tuple[list[int], str, list[dict[str, Any]] | None]:
    """A chat request's prompt ids, its tool-call format, and its tools (None when unused); the
    one rendering both /v1/chat/completions and /tokenize use, so their ids agree."""
    tools = ([t.model_dump(exclude_none=True) for t in req.tools or []]
             if req.tool_mode != "none" else None)
    template = getattr(state.tokenizer, "chat_template", None)
    knows_tools = template_knows_tools(template)
    fmt = select_format(state.settings.tool_call_parser, template)
    messages = render_messages([m.as_template_message() for m in req.messages], tools,
                               knows_tools, fmt)
    try:
        ids = await state.encoder.chat(messages, tools if knows_tools else None,
                                       **req.template_options())
    except Exception as e:  # the chat template rejects the conversation (e.g. role order)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from e
    return ids, fmt, tools


def served_names(state: ServerState) -> list[str]:
    """Every name clients may send as `model`: the served name first, then its aliases."""
    return list(dict.fromkeys([state.model_name, *state.settings.model_aliases]))


def check_model(state: ServerState, model: str) -> None:
    if model not in served_names(state):
        names = " or ".join(repr(n) for n in served_names(state))
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {names}",
                       "model", code="model_not_found")


def prompt_items(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's `prompt` as a list of prompts: a string or token ids is one, a list of strings
    or of token-id lists is several (an empty list is one empty prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]  # type: ignore[list-item]


async def _completion_prompt(state: ServerState, prompt: str | list[int],
                             index: int | None = None, special: bool = False) -> list[int]:
    """`index`: the prompt's place in a list of several (named in errors); `special`: the
    tokenizer's BOS etc. added to a text prompt (vLLM's `add_special_tokens`)."""
    which = "the prompt" if index is None else f"prompt {index}"
    ids = (await state.encoder.encode(prompt, add_special_tokens=special)
           if isinstance(prompt, str) else list(prompt))
    if not ids:
        raise bad_request(f"{which} is empty", "prompt")
    if any(not 0 <= t < state.vocab_size for t in ids):
        raise bad_request(f"{which}: token ids must be in [0, {state.vocab_size})", "prompt")
    return ids


async def _respond(request: Request, state: ServerState, req: Any, prompts: list[list[int]],
                   kind: str, arrival: float, default_max_tokens: int | None,
                   structured: StructuredOutputsParams | None = None, tool_mode: str = "none",
                   tools: ChatTools | None = None) -> Response:
    """`prompts`: one (chat) or several (completions' list of prompts), each with its choices."""
    check_token_ids(req, state.vocab_size)
    if kind == "completion":
        structured = req.structured()
    if structured is not None:
        await _compile(state, structured, "tool_choice" if tool_mode != "none"
                       else _structured_param(req))
    params = [_prompt_params(req, ids, i if len(prompts) > 1 else None, state.max_model_len,
                             default_max_tokens, structured) for i, ids in enumerate(prompts)]
    references = None
    if req.ngram is not None and req.ngram.references:
        encoded = [await state.encoder.encode(r) for r in req.ngram.references]
        references = [ids for ids in encoded if ids] or None
    gens = await _admit(state, req, kind, prompts, params, references, arrival)
    echoes = _echo_texts(state, req.prompt, prompts) if getattr(req, "echo", False) else None
    for gen in gens:
        if tools is not None:
            gen.tools, gen.tool_mode = tools.parser(), tool_mode
            gen.text = tools.text(gen.text)  # keeps the markers the parser reads
        if echoes is not None:
            gen.echo = echoes[gen.prompt_index]
            gen.echo_first_id = prompts[gen.prompt_index][0]

    def close() -> None:
        for gen in gens:
            gen.stream.close()

    if req.stream:
        return EventStreamResponse(_sse_events(state, gens), on_close=close)
    try:
        choices = await _until_done_or_disconnect(
            request, asyncio.gather(*(_collect(state, gen) for gen in gens)))
    finally:
        close()
    if choices is None:  # the client left; nobody reads this
        return Response(status_code=499)
    per_prompt = len(choices) // len(prompts)
    if per_prompt > req.n:  # best_of: each prompt's n most likely candidates, best first
        choices = [c for p in range(len(prompts)) for c in best_choices(
            gens[p * per_prompt : (p + 1) * per_prompt],
            choices[p * per_prompt : (p + 1) * per_prompt], req.n,
            keep_logprobs=req.logprobs is not None, first_index=p * req.n)]
    return JSONResponse(_full_body(gens, choices))


def _prompt_params(req: Any, prompt_ids: list[int], index: int | None, max_model_len: int,
                   default_max_tokens: int | None,
                   structured: StructuredOutputsParams | None) -> Any:
    """One prompt's SamplingParams; with several prompts, a context error names the prompt."""
    try:
        return sampling_params(req, len(prompt_ids), max_model_len, default_max_tokens,
                               structured)
    except ApiError as e:
        if index is not None and e.code == "context_length_exceeded":
            e.message = f"prompt {index}: {e.message}"
        raise


def _echo_texts(state: ServerState, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for echo: as sent, or its token ids decoded."""
    return [item if isinstance(item, str) else state.tokenizer.decode(ids)
            for item, ids in zip(prompt_items(prompt), prompts)]


def best_choices(gens: list[Generation], choices: list[dict[str, Any]], n: int,
                 keep_logprobs: bool, first_index: int = 0) -> list[dict[str, Any]]:
    """The n candidates with the highest total log-probability (OpenAI's best_of), re-indexed
    from `first_index` (one prompt's candidates of several)."""
    score = [sum(e.logprob for e in gen.logprobs) for gen in gens]
    best = sorted(range(len(choices)), key=lambda i: -score[i])[:n]
    out = []
    for rank, i in enumerate(best):
        choice = {**choices[i], "index": first_index + rank}
        if not keep_logprobs:
            choice["logprobs"] = None
        out.append(choice)
    return out


async def _compile(state: ServerState, spec: StructuredOutputsParams, param: str) -> None:
    """Compile (or find cached) the request's grammar off the event loop and the engine thread,
    so the engine only copies it; 400 if it is invalid or takes too long."""
    grammars = state.engine.engine.grammars
    timeout = state.settings.grammar_compile_timeout
    try:
        await asyncio.wait_for(asyncio.to_thread(grammars.compile, spec), timeout)
    except GrammarError as e:
        raise bad_request(str(e), param, code="invalid_grammar") from e
    except TimeoutError as e:  # the thread finishes on its own (llguidance's fuel bounds it)
        raise bad_request(f"compiling the {spec.kind} took longer than {timeout:g} s",
                          param, code="grammar_too_complex") from e


def _structured_param(req: Any) -> str:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar"):
        if getattr(req, name, None) is not None:
            return name
    return "response_format"


async def _admit(state: ServerState, req: Any, kind: str, prompts: list[list[int]],
                 params: list[Any], references: list[list[int]] | None,
                 arrival: float) -> list[Generation]:
    """Every prompt's choices, in choice order; if one prompt is refused, none runs."""
    if state.engine.num_in_flight + len(prompts) > state.settings.max_in_flight:
        raise ApiError(429, f"too many requests in flight ({state.settings.max_in_flight})",
                       type="rate_limit_error", code="overloaded")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    gens: list[Generation] = []
    try:
        for p, (prompt_ids, prompt_params) in enumerate(zip(prompts, params)):
            # the engine's id of each prompt; the response keeps request_id
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            streams = await _add(state, kind, engine_id, prompt_ids, prompt_params, references,
                                 p if len(prompts) > 1 else None, req.stream)
            state.metrics.on_prompt(len(prompt_ids))
            for i, stream in enumerate(streams):
                gen = Generation(kind, request_id, state.model_name, created, len(prompt_ids),
                                 stream, TextAssembler(state.tokenizer, prompt_params.stop,
                                                       prompt_params.skip_special_tokens,
                                                       prompt_params.include_stop_str_in_output),
                                 req.include_usage, arrival, index=p * len(streams) + i,
                                 prompt_index=p)
                if prompt_params.logprobs is not None:
                    gen.num_top_logprobs = prompt_params.logprobs
                    gen.token_text = TokenText(state.tokenizer)
                gens.append(gen)
    except BaseException:
        for gen in gens:
            gen.stream.close()
        raise
    return gens


async def _add(state: ServerState, kind: str, engine_id: str, prompt_ids: list[int],
               params: Any, references: list[list[int]] | None,
               index: int | None, stream: bool) -> list[RequestStream]:
    try:
        return await state.engine.add_choices(engine_id, prompt_ids, params, references, stream)
    except EngineStopped as e:
        raise ApiError(503, str(e), type="server_error", code="shutting_down") from e
    except ValueError as e:  # the engine's own checks: prompt vs context, KV capacity
        message = str(e) if index is None else f"prompt {index}: {e}"
        raise bad_request(message, "messages" if kind == "chat" else "prompt") from e


# ---- consuming events -----------------------------------------------------------------------

def _observe(state: ServerState, gen: Generation, event: TokenEvent) -> None:
    n = len(event.token_ids)
    if not n:
        return
    now, m = time.perf_counter(), state.metrics
    if gen.last_token_time is None:
        m.on_first_token(now - gen.arrival)
        n -= 1  # the first token's wait is TTFT, not ITL
    else:
        m.on_token_gap((now - gen.last_token_time) / n, n)
    gen.last_token_time = now
    gen.num_output_tokens += len(event.token_ids)
    m.on_tokens(len(event.token_ids))


def _finish(state: ServerState, gen: Generation, event: TokenEvent) -> None:
    reason = None if event.error is not None else event.finish_reason
    state.metrics.on_finish(reason, time.perf_counter() - gen.arrival, gen.num_prompt_tokens,
                            gen.num_output_tokens)


async def _collect(state: ServerState, gen: Generation) -> dict[str, Any]:
    async for event in gen.stream.events():
        _observe(state, gen, event)
        gen.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            gen.prompt_logprobs = event.prompt_logprobs
        if not event.finished:
            gen.text.extend(event.token_ids)
            continue
        _finish(state, gen, event)
        if event.error is not None:
            raise ApiError(503, event.error, type="server_error", code="aborted")
        gen.spec = event.spec
        return _choice_body(gen, (gen.echo or "") + gen.text.finish(event.token_ids,
                                                                    event.stop_text_len), event)
    raise AssertionError("the event stream ended without a final event")


async def _until_done_or_disconnect(request: Request, work: Any) -> Any:
    """`work`'s result, or None if the client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- bodies ---------------------------------------------------------------------------------

def usage(gens: list[Generation]) -> dict[str, int]:
    """Each prompt once (its K/V is shared by its choices), every choice's completion."""
    prompt = sum({g.prompt_index: g.num_prompt_tokens for g in gens}.values())
    completion = sum(g.num_output_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def speculation(specs: list[SpecStats | None]) -> dict[str, Any]:
    """Every choice's verify counters summed."""
    total = SpecStats()
    for spec in specs:
        if spec is not None:
            total.verify_steps += spec.verify_steps
            total.draft_tokens += spec.draft_tokens
            total.accepted_tokens += spec.accepted_tokens
            total.mean_acceptance_length += spec.mean_acceptance_length * spec.verify_steps
    if total.verify_steps:
        total.mean_acceptance_length /= total.verify_steps
    return asdict(total)


def _finish_reason(gen: Generation, reason: str | None, has_calls: bool) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call; a named tool_choice ends with "stop".
    if has_calls and reason == "stop" and gen.tool_mode != "named":
        return "tool_calls"
    return reason


def _full_body(gens: list[Generation], choices: list[dict[str, Any]]) -> dict[str, Any]:
    gen = gens[0]
    obj = "chat.completion" if gen.kind == "chat" else "text_completion"
    return {"id": gen.request_id, "object": obj, "created": gen.created, "model": gen.model,
            "choices": choices, "usage": usage(gens),
            "speculation": speculation([g.spec for g in gens])}


def _choice_body(gen: Generation, text: str, event: TokenEvent) -> dict[str, Any]:
    if gen.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = event.finish_reason
        if gen.tools is not None:
            content, calls = gen.tools.push(text)
            rest, more = gen.tools.finish()
            content = (content + rest).strip()
            message = {"role": "assistant", "content": content or None}
            if calls + more:
                message["tool_calls"] = [c.body() for c in calls + more]
            reason = _finish_reason(gen, reason, bool(calls + more))
        return {"index": gen.index, "message": message,
                "logprobs": gen.logprobs_body(gen.logprobs), "finish_reason": reason}
    prompt = gen.prompt_logprobs if gen.echo is not None else None
    return {"index": gen.index, "text": text, "logprobs": gen.logprobs_body(gen.logprobs, prompt),
            "finish_reason": event.finish_reason}


def _chunk(gen: Generation, text: str | None, finish_reason: str | None = None,
           role: bool = False, logprobs: dict[str, Any] | None = None,
           calls: list[ToolCall] | None = None) -> dict[str, Any]:
    if gen.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if calls:
            first = len(gen.tools.calls) - len(calls) if gen.tools is not None else 0
            delta["tool_calls"] = [c.body(first + i) for i, c in enumerate(calls)]
        choice = {"index": gen.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": gen.index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": gen.request_id, "object": obj, "created": gen.created, "model": gen.model,
            "choices": [choice]}


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _sse_events(state: ServerState, gens: list[Generation]) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come (interleaved for n > 1), then usage and [DONE]."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for chunk in _choice_chunks(state, gen):
                await queue.put(chunk)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(gen)) for gen in gens]
    try:
        running, failed = len(tasks), False
        while running:
            chunk = await queue.get()
            if chunk is None:
                running -= 1
                continue
            yield _sse(chunk)
            if "error" in chunk:
                failed = True
                break
        if not failed and gens[0].include_usage:
            yield _sse({**_chunk(gens[0], None), "choices": [], "usage": usage(gens)})
    finally:
        for task in tasks:
            task.cancel()
    yield _sse("[DONE]")


async def _choice_chunks(state: ServerState, gen: Generation) -> AsyncIterator[dict[str, Any]]:
    """One choice's stream chunks (an OpenAI error body instead, if its request failed)."""
    if gen.kind == "chat":
        yield _chunk(gen, "", role=True)
    if gen.echo:
        yield _chunk(gen, gen.echo)
    async for event in gen.stream.events():
        _observe(state, gen, event)
        prompt = event.prompt_logprobs if gen.echo is not None else None
        if not event.finished:
            delta = gen.text.push(event.token_ids)
            calls: list[ToolCall] = []
            if gen.tools is not None:
                delta, calls = gen.tools.push(delta)
            # a chunk per step that has text or logprobs (a token's text may come a step later)
            logprobs = gen.logprobs_body(event.logprobs, prompt) if event.logprobs else None
            if delta or calls or logprobs is not None:
                yield _chunk(gen, delta if delta or not calls else None, logprobs=logprobs,
                             calls=calls)
            continue
        _finish(state, gen, event)
        if event.error is not None:
            yield ApiError(503, event.error, type="server_error", code="aborted").body()
            return
        text = gen.text.finish(event.token_ids, event.stop_text_len)
        reason, calls = event.finish_reason, []
        if gen.tools is not None:
            text, calls = gen.tools.push(text)
            rest, more = gen.tools.finish()
            text, calls = text + rest, calls + more
            reason = _finish_reason(gen, reason, bool(gen.tools.calls))
        last = _chunk(gen, text if text or not calls else None, reason,
                      logprobs=gen.logprobs_body(event.logprobs, prompt) if event.logprobs else None,
                      calls=calls)
        last["speculation"] = speculation([event.spec])
        yield last


class EventStreamResponse(StreamingResponse):
    """SSE response that runs `on_close` however it ends: done, client gone, or cancelled
    before the body started (then the generator never runs its own cleanup)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
