"""Server pieces without a live server: streaming detokenisation, request validation, path
confinement and the body limit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_token_ids,
    parse_json,
    sampling_params,
    validate,
)
from ngramspec.server.security import BodyLimitMiddleware, corpus_files, resolve_under
from ngramspec.server.text import TextAssembler


@pytest.fixture(scope="module")
def tokenizer():
    from ngramspec.models.loader import load_tokenizer

    return load_tokenizer(None)


# ---- TextAssembler ---------------------------------------------------------------------------

TEXTS = ["Hello, world! Ça va? 日本語のテキスト 🙂 done.",
         "def f(x):\n    return x  # 🐍\n",
         "aaa bbb aaa bbb stop here STOP there", "\u00e9\u00e8 ★★ \U0001f600\U0001f600",
         "<|im_start|>assistant\nyes<|im_end|> and more<|endoftext|>"]


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=40),
       stop_at=st.integers(0, 200), stop_len=st.integers(1, 5), extra=st.integers(0, 3),
       include=st.booleans(), skip=st.booleans())
def test_streamed_text_equals_final_text(tokenizer, text: str, cuts: list[int], stop_at: int,
                                         stop_len: int, extra: int, include: bool,
                                         skip: bool) -> None:
    """Deltas joined == the offline text, whatever the chunking (speculative bursts) and wherever
    a stop string cuts (include_stop_str_in_output or not, special tokens skipped or not);
    nothing streamed is ever taken back."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    stop = full[stop_at % len(full):][:stop_len]
    # Like check_stop: the first token whose text completes the stop ends the request.
    end, cut = len(ids), None
    for n in range(1, len(ids) + 1):
        found = tokenizer.decode(ids[:n], skip_special_tokens=skip).find(stop)
        if found >= 0:
            end, cut = n, found + (len(stop) if include else 0)
            break
    final = tokenizer.decode(ids[:end], skip_special_tokens=skip)[:cut]
    assembler, sent, pos = TextAssembler(tokenizer, [stop], skip, include), "", 0
    chunks = []
    for size in cuts:
        if pos >= end:
            break
        chunks.append(ids[pos : min(end, pos + size)])
        pos += size
    if pos < end:
        chunks.append(ids[pos:end])
    for chunk in chunks[:-1]:
        sent += assembler.push(chunk)
        assert final.startswith(sent)  # never ahead of the final text
    sent += assembler.finish(chunks[-1], cut)
    assert sent == final


def test_partial_utf8_is_held_back(tokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji
    assembler = TextAssembler(tokenizer, [])
    assert assembler.push(ids[:1]) == ""  # a lone byte would decode to U+FFFD
    assert assembler.finish(ids[1:], None) == "🙂"


# ---- protocol --------------------------------------------------------------------------------

def _completion(**body) -> CompletionRequest:
    return validate(CompletionRequest, {"model": "m", "prompt": "p", **body})


@pytest.mark.parametrize("body,param", [
    ({"temperature": "0.5"}, "temperature"),  # strict types, as OpenAI
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"n": 0}, "n"),
    ({"best_of": 0}, "best_of"),
    ({"echo": "yes"}, "echo"),
    ({"logit_bias": {"1": 101}}, "logit_bias.1"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids.0"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"response_format": {"type": "json_objectx"}}, "response_format.type"),
    ({"seed": 2**64}, "seed"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"ngram": {"reference": 5}}, "ngram.reference"),
])
def test_invalid_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        _completion(**body)
    assert e.value.status == 400 and e.value.param == param


def test_values_that_ask_for_nothing_are_accepted() -> None:
    req = _completion(n=1, logprobs=None, echo=False, logit_bias={}, tools=[], best_of=1,
                      response_format={"type": "text"}, user="x", whatever={"a": 1})
    assert req.n == 1


def _chat(**body) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x"}], **body})


# OpenAI's nullable fields (null: the field's default), and vLLM's optional ones
NULLABLE_COMMON = ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                   "max_tokens", "stop", "seed", "stream", "stream_options", "logit_bias",
                   "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                   "allowed_token_ids", "bad_words", "response_format", "ngram"]
NULLABLE_COMPLETION = ["logprobs", "echo", "best_of", "suffix"]
NULLABLE_CHAT = ["logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                 "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt"]


@pytest.mark.parametrize("route,name", [("completion", n) for n in
                                        NULLABLE_COMMON + NULLABLE_COMPLETION]
                         + [("chat", n) for n in NULLABLE_COMMON + NULLABLE_CHAT])
def test_null_means_the_default(route: str, name: str) -> None:
    make = _completion if route == "completion" else _chat
    assert make(**{name: None}) == make()
    assert sampling_params(make(**{name: None}), 4, 64, 8) == sampling_params(make(), 4, 64, 8)


def test_null_keeps_required_fields_required_and_types_strict() -> None:
    for body, param in (({"prompt": None}, "prompt"), ({"model": None}, "model"),
                        ({"temperature": "0.5"}, "temperature"), ({"n": "1"}, "n")):
        with pytest.raises(ApiError) as e:
            _completion(**body)
        assert e.value.param == param
    with pytest.raises(ApiError) as e:
        _chat(messages=None)
    assert e.value.param == "messages"


# vLLM's request fields we do not honour: a value that asks for something, one that asks nothing
VLLM_UNSUPPORTED = [
    ("use_beam_search", True, False), ("length_penalty", 0.8, 1.0),
    ("truncate_prompt_tokens", 10, None), ("prompt_logprobs", 2, None),
    ("spaces_between_special_tokens", False, True), ("guided_decoding_backend", "xgrammar", None),
    ("structural_tag", "{}", None), ("priority", 1, 0), ("request_id", "abc", None),
    ("logits_processors", ["m.P"], []), ("return_tokens_as_token_ids", True, False),
    ("return_token_ids", True, None), ("cache_salt", "salt", None),
    ("kv_transfer_params", {"a": 1}, None), ("vllm_xargs", {"a": 1}, {}),
    ("mm_processor_kwargs", {"a": 1}, None), ("prompt_embeds", "AAAA", None)]


@pytest.mark.parametrize("route", ["completion", "chat"])
@pytest.mark.parametrize("name,asks,nothing", VLLM_UNSUPPORTED)
def test_vllm_fields_we_cannot_honour_are_named(route: str, name: str, asks, nothing) -> None:
    make = _completion if route == "completion" else _chat
    with pytest.raises(ApiError) as e:
        make(**{name: asks})
    assert (e.value.status, e.value.param, e.value.code) == (400, name, "unsupported_parameter")
    assert make(**{name: nothing}) == make()


def test_route_specific_unsupported_fields() -> None:
    for make, name, asks, nothing in (
            (_chat, "echo", True, False), (_chat, "best_of", 2, 1),
            (_chat, "documents", [{"title": "t", "text": "x"}], None),
            (_chat, "chat_template", "{{ messages }}", None)):
        with pytest.raises(ApiError) as e:
            make(**{name: asks})
        assert (e.value.param, e.value.code) == (name, "unsupported_parameter")
        make(**{name: nothing})
    assert _completion(echo=True).echo  # completions' own echo
    with pytest.raises(ApiError) as e:
        _completion(stream=True, stream_options={"continuous_usage_stats": True})
    assert e.value.param == "stream_options.continuous_usage_stats"


def test_completions_add_special_tokens_reaches_the_encoder() -> None:
    import asyncio
    from types import SimpleNamespace

    from ngramspec.server.completions import _completion_prompt

    seen = []

    class Encoder:
        async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            seen.append(add_special_tokens)
            return [1, 2] if add_special_tokens else [2]

    state = SimpleNamespace(encoder=Encoder(), vocab_size=10)
    assert _completion().add_special_tokens is False  # LLM.generate's encoding by default
    for asked in (False, True):
        special = _completion(add_special_tokens=asked).add_special_tokens
        ids = asyncio.run(_completion_prompt(state, "hi", special=special))
        assert ids == ([1, 2] if asked else [2])
    assert seen == [False, True]


@pytest.mark.parametrize("make", [_completion, _chat])
def test_vllm_sampling_fields_reach_sampling_params(make) -> None:
    req = make(min_tokens=3, stop_token_ids=[7, 9], logit_bias={"5": 2, "11": -100.0},
               allowed_token_ids=[5, 6, 7], bad_words=["foo"], include_stop_str_in_output=True,
               skip_special_tokens=False, top_k=5, min_p=0.1, repetition_penalty=1.1,
               ignore_eos=True)
    p = sampling_params(req, 4, 64, 8)
    assert (p.min_tokens, p.stop_token_ids, p.logit_bias, p.allowed_token_ids, p.bad_words) == (
        3, [7, 9], {5: 2.0, 11: -100.0}, [5, 6, 7], ["foo"])
    assert p.include_stop_str_in_output and not p.skip_special_tokens and p.processes_logits
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (5, 0.1, 1.1, True)
    defaults = sampling_params(make(), 4, 64, 8)
    assert (defaults.min_tokens, defaults.logit_bias, defaults.skip_special_tokens) == (0, None,
                                                                                        True)


def test_min_tokens_and_max_tokens() -> None:
    # no max_tokens: the default grows to min_tokens (within the context)
    assert sampling_params(_completion(min_tokens=20), 4, 64, 16).max_tokens == 20
    assert sampling_params(_completion(min_tokens=5), 4, 64, 16).max_tokens == 16
    with pytest.raises(ApiError) as e:
        sampling_params(_completion(min_tokens=20, max_tokens=10), 4, 64, 16)
    assert e.value.param == "min_tokens"
    with pytest.raises(ApiError) as e:
        sampling_params(_completion(min_tokens=80), 4, 64, 16)  # more than the context holds
    assert e.value.param == "min_tokens"


def test_logit_bias_and_allowed_token_ids_name_tokens_of_the_model() -> None:
    check_token_ids(_completion(logit_bias={"0": 1, "99": -1}, allowed_token_ids=[0, 99]), 100)
    for body, param in (({"logit_bias": {"100": 1}}, "logit_bias"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"-1": 1}}, "logit_bias"),
                        ({"allowed_token_ids": [3, 100]}, "allowed_token_ids"),
                        ({"allowed_token_ids": [-1]}, "allowed_token_ids")):
        with pytest.raises(ApiError) as e:
            check_token_ids(_completion(**body), 100)
        assert e.value.param == param, body
    with pytest.raises(ApiError) as e:
        sampling_params(_completion(allowed_token_ids=[]), 4, 64, 16)
    assert e.value.param == "allowed_token_ids"


def test_chat_template_fields() -> None:
    assert _chat().template_options() == {"template_kwargs": None, "add_generation_prompt": True,
                                          "add_special_tokens": False}
    opts = _chat(chat_template_kwargs={"enable_thinking": False}, add_special_tokens=True,
                 add_generation_prompt=False).template_options()
    assert opts == {"template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
                    "add_special_tokens": True}
    # continue_final_message: no generation prompt unless asked for (then a 400, as vLLM)
    assert _chat(continue_final_message=True).template_options() == {
        "template_kwargs": {"continue_final_message": True}, "add_generation_prompt": False,
        "add_special_tokens": False}
    with pytest.raises(ApiError) as e:
        _chat(continue_final_message=True, add_generation_prompt=True).template_options()
    assert e.value.param == "continue_final_message"
    for key in ("tokenize", "chat_template", "add_generation_prompt", "tools"):
        with pytest.raises(ApiError) as e:
            _chat(chat_template_kwargs={key: 1})
        assert e.value.param == "chat_template_kwargs" and key in e.value.message


def test_chat_rejects_non_text_parts_and_malformed_tool_calls() -> None:
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    for message, param in (({"role": "user", "content": image}, "messages.0.content"),
                           ({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                            "messages.0.tool_calls.0.function"),
                           ({"role": "robot", "content": "x"}, "messages.0.role")):
        with pytest.raises(ApiError) as e:
            validate(ChatCompletionRequest, {"model": "m", "messages": [message]})
        assert e.value.param == param
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = validate(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "developer", "content": parts}]})
    assert req.messages[0].as_template_message() == {"role": "system", "content": "ab"}


def test_json_rejects_nan_and_garbage() -> None:
    for raw in (b'{"a": NaN}', b'{"a": Infinity}', b"{", b"\xff\xfe"):
        with pytest.raises(ApiError):
            parse_json(raw)
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_sampling_params_respect_the_context() -> None:
    req = _completion(max_tokens=5)
    assert sampling_params(req, 10, 16, None).max_tokens == 5
    assert sampling_params(req, 11, 16, None).max_tokens == 5  # exactly fills the context
    with pytest.raises(ApiError, match="at most 4") as e:
        sampling_params(req, 12, 16, None)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as e:
        sampling_params(_completion(), 16, 16, None)  # no room for one token
    assert e.value.param == "prompt"
    assert sampling_params(_completion(), 10, 16, 16).max_tokens == 6  # default, clipped
    chat = validate(ChatCompletionRequest, {"model": "m", "max_tokens": 3,
                                            "max_completion_tokens": 2,
                                            "messages": [{"role": "user", "content": "x"}]})
    assert sampling_params(chat, 4, 16, None).max_tokens == 2
    with pytest.raises(ApiError) as e:
        sampling_params(_completion(top_p=0), 4, 16, None)
    assert e.value.param == "top_p"
    assert sampling_params(_completion(ngram={"enabled": False}), 4, 16, 2).speculative is False
    # A denormal temperature would overflow the logits (inf/NaN): it means greedy.
    assert sampling_params(_completion(temperature=5e-324), 4, 16, 2).temperature == 0.0
    assert sampling_params(_completion(temperature=0.3), 4, 16, 2).temperature == 0.3


# ---- paths and body limit --------------------------------------------------------------------

def test_paths_are_confined(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a.txt").write_text("a")
    (tmp_path / "secret").write_text("s")
    (root / "out").symlink_to(tmp_path / "secret")
    (root / "d" / "out").symlink_to(tmp_path / "secret")
    assert corpus_files(root, "d/a.txt") == [(root / "d" / "a.txt").resolve()]
    for bad in ("../secret", str(tmp_path / "secret"), "out", "d", "d/../../secret"):
        with pytest.raises(ApiError) as e:
            corpus_files(root, bad)
        assert e.value.status == 403, bad
    for bad, status in (("", 400), ("d/*.txt", 400), ("nope", 404), ("a\x00b", 400)):
        with pytest.raises(ApiError) as e:
            corpus_files(root, bad)
        assert e.value.status == status
    with pytest.raises(ApiError) as e:
        resolve_under(None, "a")
    assert e.value.status == 403
    assert resolve_under(root, "new/file.ngt", must_exist=False) == (root / "new/file.ngt")


def _call(app, body_chunks: list[bytes], content_length: str | None) -> tuple[int, bytes]:
    headers = [] if content_length is None else [(b"content-length", content_length.encode())]
    scope = {"type": "http", "path": "/v1/x", "headers": headers}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1}
                for i, c in enumerate(body_chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(BodyLimitMiddleware(app, max_bytes=10)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_body_limit_counts_declared_and_streamed_bytes() -> None:
    async def echo(scope, receive, send) -> None:
        body = b""
        while (m := await receive())["type"] == "http.request":
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    assert _call(echo, [b"12345", b"67890"], None) == (200, b"1234567890")
    status, body = _call(echo, [b"123456", b"78901"], None)  # 11 bytes, no Content-Length
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert _call(echo, [b"1"], "11")[0] == 413  # announced too big: refused unread
    assert _call(echo, [b"1"], "-1")[0] == 413  # a malformed length is refused too
    assert _call(echo, [b"1234567890"], "10") == (200, b"1234567890")


# ---- learned corpus persistence --------------------------------------------------------------

def _fake_engine(**drafter_overrides):
    """What learned.py touches: engine.speculator.drafter and engine.config.drafter."""
    from types import SimpleNamespace

    from ngramspec.drafting.config import DrafterConfig
    from ngramspec.drafting.factory import make_drafter

    config = DrafterConfig(**drafter_overrides)
    drafter = make_drafter(config)
    return SimpleNamespace(speculator=SimpleNamespace(drafter=drafter),
                           config=SimpleNamespace(drafter=config))


def test_learned_corpus_round_trip(tmp_path: Path) -> None:
    import numpy as np

    from ngramspec.corpus.ngc import CorruptFileError
    from ngramspec.server import learned, state

    source = _fake_engine()
    source.speculator.drafter.start("r", [5, 6, 7, 5, 6, 8, 5, 6, 7])
    meta, arrays = learned.snapshot(source)
    assert meta["num_nodes"] > 1
    path = tmp_path / "learned.ngt"
    learned.write(path, (meta, arrays))
    target = _fake_engine()
    old_epoch = target.speculator.drafter.trie.epoch
    state.restore_learned(target, path)  # what --corpus-state does at start-up
    restored_meta, restored = learned.snapshot(target)
    assert restored_meta["num_nodes"] == meta["num_nodes"]
    for name in arrays:
        np.testing.assert_array_equal(restored[name], arrays[name])
    assert target.speculator.drafter.trie.epoch > old_epoch  # running requests re-anchor
    learned.flush(target)
    assert learned.info(target)["num_nodes"] == 1
    with pytest.raises(CorruptFileError, match="depth"):
        state.restore_learned(_fake_engine(max_trie_depth=7), path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptFileError):
        state.restore_learned(_fake_engine(), path)
    off = _fake_engine()
    off.speculator = None
    with pytest.raises(learned.NoLearnedCorpus):
        learned.snapshot(off)
    state.restore_learned(off, path)  # speculation off: a warning, not a failure


# ---- AsyncEngine with a scripted engine ------------------------------------------------------

class _ScriptedEngine:
    """The LLMEngine surface AsyncEngine uses. Each step gives every request its next token
    (100, 101, ...) until max_tokens; a step that would serve request `fail_for` raises.
    Records the threads that touched it."""

    def __init__(self, fail_for: str | None = None) -> None:
        from types import SimpleNamespace

        self.allocator = SimpleNamespace(num_free=100, num_usable=100)
        self.scheduler = SimpleNamespace(running=[], waiting=[], max_num_seqs=8, cache=None,
                                         num_available=100)
        self.stats = SimpleNamespace(num_steps=0)
        self.fail_for = fail_for
        self.threads: set[str] = set()

    def _touch(self) -> None:
        import threading

        self.threads.add(threading.current_thread().name)

    def close(self) -> None:
        self._touch()

    def add_request(self, request_id, prompt_ids, params, references=None):
        from ngramspec.engine.sequence import Sequence, Status

        self._touch()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        seq = Sequence(len(self.scheduler.running), request_id, list(prompt_ids),
                       len(prompt_ids), params, ())
        seq.status = Status.RUNNING
        self.scheduler.running.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        self._touch()
        self.scheduler.running = [s for s in self.scheduler.running
                                  if s.request_id != request_id]

    def has_unfinished(self) -> bool:
        self._touch()
        return bool(self.scheduler.running)

    def step(self):
        from ngramspec.engine.engine import StepOutput
        from ngramspec.engine.sequence import Status

        self._touch()
        self.stats.num_steps += 1
        if any(s.request_id == self.fail_for for s in self.scheduler.running):
            raise RuntimeError("boom")
        outputs = []
        for seq in list(self.scheduler.running):
            seq.token_ids.append(100 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish_reason, seq.status = "length", Status.FINISHED
                self.scheduler.running.remove(seq)
            outputs.append(StepOutput(seq, [seq.token_ids[-1]]))
        return outputs


def _drive(engine: _ScriptedEngine, scenario) -> object:
    from ngramspec.server.async_engine import AsyncEngine

    async def main():
        bridge = AsyncEngine(engine)  # type: ignore[arg-type]
        bridge.start()
        try:
            return await scenario(bridge)
        finally:
            await bridge.stop()

    return asyncio.run(main())


def test_async_engine_streams_in_order_and_only_the_engine_thread_touches_it() -> None:
    from ngramspec.sampling_params import SamplingParams

    async def scenario(bridge):
        streams = [await bridge.add(f"r{i}", [1, 2], SamplingParams(max_tokens=3 + i))
                   for i in range(3)]
        with pytest.raises(ValueError, match="empty"):
            await bridge.add("bad", [], SamplingParams())
        results = []
        for stream in streams:
            events = [e async for e in stream.events()]
            results.append(([t for e in events for t in e.token_ids], events[-1].finish_reason))
        return results, bridge.num_in_flight

    engine = _ScriptedEngine()
    results, in_flight = _drive(engine, scenario)
    assert results == [([100 + k for k in range(3 + i)], "length") for i in range(3)]
    assert in_flight == 0
    assert engine.threads == {"engine"}


def test_a_built_engine_is_made_and_stepped_on_one_thread() -> None:
    """AsyncEngine.build runs the factory on the thread that later steps the engine (one OpenMP
    team in the process), hands on the factory's error, and stops cleanly if never started."""
    import threading

    from ngramspec.sampling_params import SamplingParams
    from ngramspec.server.async_engine import AsyncEngine

    made_on = []

    def factory():
        made_on.append(threading.get_ident())
        return _ScriptedEngine()

    async def main():
        bridge = AsyncEngine.build(factory)  # type: ignore[arg-type]
        bridge.start()
        try:
            stream = await bridge.add("r", [1, 2], SamplingParams(max_tokens=2))
            tokens = [t async for e in stream.events() for t in e.token_ids]
            stepped_on = await bridge.call(lambda e: threading.get_ident())
        finally:
            await bridge.stop()
        return bridge, tokens, stepped_on

    bridge, tokens, stepped_on = asyncio.run(main())
    assert tokens == [100, 101] and made_on == [stepped_on] != [threading.get_ident()]
    assert bridge.engine.threads == {"engine"} and not bridge.running

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(broken)  # type: ignore[arg-type]
    idle = AsyncEngine.build(factory)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(idle.stop(), 10))  # never started: its thread still ends
    assert not idle.running


def test_async_engine_close_aborts_and_a_failed_step_fails_every_request() -> None:
    from ngramspec.sampling_params import SamplingParams

    async def scenario(bridge):
        left = await bridge.add("left", [1], SamplingParams(max_tokens=10**6))
        await left.next()
        left.close()  # the client went away
        await bridge.call(lambda e: None)  # the abort is queued before this call
        running = await bridge.call(lambda e: [s.request_id for s in e.scheduler.running])
        doomed = await bridge.add("doomed", [1], SamplingParams(max_tokens=10**6))
        events = [e async for e in doomed.events()]
        assert len(events) == 1
        return running, events[-1].error, bridge.failures, bridge.snapshot.num_running

    running, error, failures, num_running = _drive(_ScriptedEngine(fail_for="doomed"), scenario)
    assert running == []
    assert error == "internal error in the engine" and failures == 1 and num_running == 0


def test_slow_grammar_compile_is_a_400_and_leaves_the_loop_free() -> None:
    """The wall-time bound: a compile slower than grammar_compile_timeout answers 400."""
    import threading
    from types import SimpleNamespace

    from ngramspec.server.completions import _compile
    from ngramspec.structured.params import StructuredOutputsParams

    release = threading.Event()

    def slow_compile(spec):
        release.wait(5)

    grammars = SimpleNamespace(compile=slow_compile)
    state = SimpleNamespace(engine=SimpleNamespace(engine=SimpleNamespace(grammars=grammars)),
                            settings=SimpleNamespace(grammar_compile_timeout=0.05))

    async def main() -> None:
        with pytest.raises(ApiError) as e:
            await _compile(state, StructuredOutputsParams(regex="a"), "guided_regex")
        release.set()
        assert e.value.status == 400 and e.value.code == "grammar_too_complex"
        assert e.value.param == "guided_regex"

    asyncio.run(main())


# ---- vLLM drop-in: routes, CORS, OpenAPI, aliases (a live app over the scripted engine) -------

API = {"Authorization": "Bearer unit-key"}


class _CountingEngine(_ScriptedEngine):
    """Records the requests that reached the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[str] = []

    def add_request(self, request_id, prompt_ids, params, references=None):
        self.added.append(request_id)
        return super().add_request(request_id, prompt_ids, params, references)


def _client(tokenizer, engine: _ScriptedEngine | None = None, **settings):
    """A TestClient over create_app with the scripted engine, served as "tiny" (64 tokens)."""
    import copy

    from fastapi.testclient import TestClient

    from ngramspec.corpus.registry import ExternalCorpora
    from ngramspec.server.app import create_app
    from ngramspec.server.async_engine import AsyncEngine
    from ngramspec.server.metrics import ServerMetrics
    from ngramspec.server.state import Encoder, ServerSettings, ServerState

    state = ServerState(ServerSettings(**{"api_key": "unit-key"} | settings),
                        AsyncEngine(engine or _ScriptedEngine()),  # type: ignore[arg-type]
                        tokenizer, Encoder(copy.deepcopy(tokenizer)),
                        ExternalCorpora(1000, progress=False), tokenizer,
                        ServerMetrics(model_name="tiny"), "tiny", 64, len(tokenizer))
    return TestClient(create_app(state))


def test_a_list_of_prompts_gives_each_its_choices_in_openai_order(tokenizer) -> None:
    engine = _CountingEngine()
    with _client(tokenizer, engine) as c:
        body = {"model": "tiny", "prompt": ["Hello", "The world"], "max_tokens": 3,
                "echo": True}
        resp = c.post("/v1/completions", json=body, headers=API).json()
        single = [c.post("/v1/completions", json=body | {"prompt": p}, headers=API).json()
                  for p in body["prompt"]]
        assert [ch["index"] for ch in resp["choices"]] == [0, 1]
        # the scripted engine answers every prompt alike: echo tells the prompts apart
        assert [ch["text"] for ch in resp["choices"]] == \
            [s["choices"][0]["text"] for s in single]
        assert resp["choices"][1]["text"].startswith("The world")
        assert resp["usage"] == {k: sum(s["usage"][k] for s in single) for k in resp["usage"]}
        ids = [[1, 2], [3, 4, 5]]
        stream = c.post("/v1/completions", headers=API, json={
            "model": "tiny", "prompt": ids, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}).text
        chunks = [json.loads(line[6:]) for line in stream.splitlines()
                  if line.startswith("data: {")]
        texts: dict[int, str] = {}
        for chunk in chunks[:-1]:
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        whole = c.post("/v1/completions", headers=API, json={
            "model": "tiny", "prompt": ids, "max_tokens": 2}).json()
        assert texts == {ch["index"]: ch["text"] for ch in whole["choices"]} and len(texts) == 2
        assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                       "total_tokens": 9}
        before = len(engine.added)
        too_long = c.post("/v1/completions", headers=API, json={
            "model": "tiny", "prompt": [[1, 2], list(range(1, 80))], "max_tokens": 2})
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()["error"]
        assert error["param"] == "prompt" and error["message"].startswith("prompt 1:")
        bad_id = c.post("/v1/completions", headers=API, json={
            "model": "tiny", "prompt": [[1], [10**9]]})
        assert bad_id.status_code == 400 and "prompt 1" in bad_id.json()["error"]["message"]
        assert len(engine.added) == before  # refused before any prompt ran


def test_tokenize_and_detokenize_round_trip_with_vllm_shapes(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with _client(tokenizer) as c:
        text = "Hello, world! Ça va? 🙂"
        resp = c.post("/tokenize", json={"prompt": text, "return_token_strs": True},
                      headers=API).json()
        assert resp["tokens"] == tokenizer.encode(text) and resp["count"] == len(resp["tokens"])
        assert resp["max_model_len"] == 64
        assert resp["token_strs"] == tokenizer.convert_ids_to_tokens(resp["tokens"])
        back = c.post("/detokenize", json={"model": "tiny", "tokens": resp["tokens"]},
                      headers=API).json()
        assert back == {"prompt": text}
        chat = c.post("/tokenize", json={"model": "tiny", "messages": messages},
                      headers=API).json()
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)["input_ids"]
        assert chat["tokens"] == list(expected) and chat["token_strs"] is None
        bare = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      headers=API).json()
        assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
        rendered = c.post("/detokenize", json={"tokens": chat["tokens"]}, headers=API).json()
        assert rendered["prompt"].endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401  # the key, as /v1
        for route, body, param in (("/detokenize", {"tokens": [len(tokenizer)]}, "tokens"),
                                   ("/tokenize", {"prompt": "a", "messages": messages},
                                    "prompt"),
                                   ("/tokenize", {"prompt": 3}, "prompt"),
                                   ("/tokenize", {}, "prompt")):
            bad = c.post(route, json=body, headers=API)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        unknown = c.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}, headers=API)
        assert unknown.status_code == 404


def test_model_aliases_are_served_and_listed(tokenizer) -> None:
    with _client(tokenizer, model_aliases=["tiny-chat", "org/tiny"]) as c:
        listed = c.get("/v1/models", headers=API).json()["data"]
        assert [m["id"] for m in listed] == ["tiny", "tiny-chat", "org/tiny"]
        assert c.get("/v1/models/org/tiny", headers=API).json()["id"] == "org/tiny"
        for name in ("tiny", "tiny-chat", "org/tiny"):
            resp = c.post("/v1/completions", headers=API,
                          json={"model": name, "prompt": "Hi", "max_tokens": 1})
            assert resp.status_code == 200 and resp.json()["model"] == "tiny"
        unknown = c.post("/v1/completions", headers=API,
                         json={"model": "tiny-2", "prompt": "Hi", "max_tokens": 1})
        assert unknown.status_code == 404 and "tiny-chat" in unknown.json()["error"]["message"]


def test_cors_preflight_from_an_allowed_origin_needs_no_key(tokenizer) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with _client(tokenizer, allowed_origins=["http://ui.example"]) as c:
        ok = c.options("/v1/chat/completions", headers={"Origin": "http://ui.example"} | preflight)
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://ui.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        other = c.options("/v1/chat/completions", headers={"Origin": "http://evil.example"}
                          | preflight)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        real = c.get("/v1/models", headers={"Origin": "http://ui.example"} | API)
        assert real.status_code == 200
        assert real.headers["access-control-allow-origin"] == "http://ui.example"
        refused = c.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert refused.status_code == 401  # CORS opens preflights only, not the API
        assert refused.headers["access-control-allow-origin"] == "http://ui.example"
    with _client(tokenizer) as c:  # no --allowed-origins: no CORS at all
        resp = c.options("/v1/models", headers={"Origin": "http://ui.example"} | preflight)
        assert resp.status_code == 401 and "access-control-allow-origin" not in resp.headers


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_publishes_the_request_bodies_and_docs_answer(tokenizer) -> None:
    with _client(tokenizer) as c:
        assert c.get("/docs").status_code == 200  # open, like /health (browsers send no key)
        doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in (("/v1/completions", "CompletionRequest", "prompt"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/detokenize", "DetokenizeRequest", "tokens")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
        assert field in schemas[model]["properties"] and field in schemas[model]["required"]
    assert "JsonSchemaFormat" in schemas  # nested models are components too
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert len(tokenize["schema"]["anyOf"]) == 2
    prefix = "#/components/schemas/"
    for ref in _refs(doc):  # every reference resolves (no pydantic "#/$defs/...")
        assert ref.startswith(prefix) and ref[len(prefix):] in schemas, ref


# ---- vLLM metric names -----------------------------------------------------------------------

def _samples(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_vllm_spec_decode_counters_follow_the_verify_steps() -> None:
    """Per verify step: one draft if it had draft tokens, its accepted path's length counted at
    positions 0..len-1; steps without drafts and prefill steps count nothing."""
    from types import SimpleNamespace

    from ngramspec.engine.engine import StepOutput
    from ngramspec.engine.sequence import Sequence, SpecCounters, Status
    from ngramspec.engine.stats import EngineStats
    from ngramspec.sampling_params import SamplingParams
    from ngramspec.server.async_engine import EngineSnapshot
    from ngramspec.server.metrics import ServerMetrics

    metrics = ServerMetrics(max_acceptance_length=8, model_name="tiny")
    fresh = _samples(metrics.render(EngineSnapshot(10, 10, 0, 0, 0, 0), 0).decode())
    assert [fresh[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",'
                  f'position="{i}"}}'] for i in range(7)] == [0.0] * 7  # every series from start
    engine = SimpleNamespace(stats=EngineStats(), scheduler=SimpleNamespace(
        cache=None, max_num_seqs=8, running=[], waiting=[]))
    seqs = [Sequence(i, f"r{i}", [1, 2], 2, SamplingParams(), ()) for i in range(2)]
    # (drafts, accepted) per step and request; None: a step that does not verify it (prefill)
    script = [[None, None], [(5, 3), (4, 0)], [(0, 0), (6, 6)], [(3, 1), None]]
    for step in script:
        outputs = []
        for seq, verify in zip(seqs, step):
            if verify is not None:
                counters = SpecCounters(1, verify[0], verify[1], verify[1] + 1)
                seq.spec.add(counters)
                engine.stats.add(counters)
            outputs.append(StepOutput(seq, [7] * (1 + (verify or (0, 0))[1])))
        metrics.on_step(engine, outputs)  # type: ignore[arg-type]
    seqs[0].status = Status.FINISHED
    values = _samples(metrics.render(EngineSnapshot(10, 10, 0, 1, 0, 4), 0).decode())
    label = '{model_name="tiny"}'
    assert values["vllm:spec_decode_num_drafts_total" + label] == 4  # (0, 0) drafted nothing
    assert values["vllm:spec_decode_num_draft_tokens_total" + label] == 18
    assert values["vllm:spec_decode_num_accepted_tokens_total" + label] == 10
    per_pos = [values.get(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name='
                          f'"tiny",position="{i}"}}', 0.0) for i in range(8)]
    assert per_pos == [3, 2, 2, 1, 1, 1, 0, 0]
    assert values["ngramspec_spec_accepted_tokens_total"] == 10  # the engine's own count agrees
    assert values["vllm:num_requests_running" + label] == 1
    assert values["vllm:kv_cache_usage_perc" + label] == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.floats(0.0, 0.03)), min_size=1, max_size=40))
def test_held_events_of_a_non_streamed_request_lose_and_reorder_nothing(steps) -> None:
    """A non-streamed request's events on the engine thread: the first goes out at once, later
    ones at most HOLD_S apart, the finish flushes the rest; together they are every step's tokens
    and logprobs in order."""
    from ngramspec.server.async_engine import HOLD_S, AsyncEngine, Held, TokenEvent

    engine = AsyncEngine.__new__(AsyncEngine)  # only the holding state, no model
    engine._held = {"r": Held()}
    sent, made, now, last_sent = [], [], 0.0, None
    for i, (n, gap) in enumerate(steps):
        now += gap
        ids = list(range(len(made), len(made) + n))
        made += ids
        final = i == len(steps) - 1
        out = engine._hold("r", TokenEvent(ids, "length" if final else None, logprobs=ids), now)
        if i == 0 or final:
            assert out is not None, "the first and the last tokens go out at once"
        if out is not None:
            assert out.logprobs == out.token_ids
            sent.append(out)
            last_sent = now
        else:
            assert now - (last_sent or 0.0) < HOLD_S + 0.03 + 1e-9
    assert [t for e in sent for t in e.token_ids] == made
    assert [e.finished for e in sent] == [False] * (len(sent) - 1) + [True]
    assert "r" not in engine._held


def test_only_non_streamed_choices_are_held() -> None:
    """`add_choices(stream=False)` asks the engine thread to hold every choice's tokens;
    a streamed request's go out at every step."""
    import threading

    from ngramspec.sampling_params import SamplingParams
    from ngramspec.server.async_engine import AsyncEngine

    engine = AsyncEngine.__new__(AsyncEngine)  # only what admitting touches, no model
    engine.accepting, engine._thread, engine._streams = True, threading.current_thread(), {}
    held: list[list[str]] = []

    async def send(kind: str, payload: tuple) -> None:
        held.append(payload[-1])

    engine._send = send

    async def admit() -> None:
        await engine.add_choices("a", [1, 2], SamplingParams(n=2), stream=True)
        await engine.add_choices("b", [1, 2], SamplingParams(n=2), stream=False)
        await engine.add("c", [1, 2], SamplingParams(), stream=False)

    asyncio.run(admit())
    assert held == [[], ["b", "b/1"], ["c"]]
