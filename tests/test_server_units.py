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
         "aaa bbb aaa bbb stop here STOP there", "\u00e9\u00e8 ★★ \U0001f600\U0001f600"]


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=40),
       stop_at=st.integers(0, 200), stop_len=st.integers(1, 5), extra=st.integers(0, 3))
def test_streamed_text_equals_final_text(tokenizer, text: str, cuts: list[int], stop_at: int,
                                         stop_len: int, extra: int) -> None:
    """Deltas joined == the offline text, whatever the chunking (speculative bursts) and wherever
    a stop string cuts; nothing streamed is ever taken back."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full[stop_at % len(full):][:stop_len]
    # Like check_stop: the first token whose text completes the stop ends the request.
    end, cut = len(ids), None
    for n in range(1, len(ids) + 1):
        found = tokenizer.decode(ids[:n], skip_special_tokens=True).find(stop)
        if found >= 0:
            end, cut = n, found
            break
    final = tokenizer.decode(ids[:end], skip_special_tokens=True)[:cut]
    assembler, sent, pos = TextAssembler(tokenizer, [stop]), "", 0
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
    ({"logit_bias": {"1": 5}}, "logit_bias"),
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
