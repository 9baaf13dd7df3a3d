"""The OpenAI-compatible server, end to end: one live `ngramspec serve` subprocess on 127.0.0.1
(speculation on, API key, corpus dir), driven by the real openai client and raw httpx.

References come from the offline LLM (speculation off) run one prompt at a time, so every
equality below also checks that serving, batching and speculation change no greedy token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_cases import ADD, WEATHER

from ngramspec import LLM, SamplingParams
from ngramspec.corpus import ngc as persist

pytestmark = pytest.mark.model

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512  # NOTE: 256 trips measure_cost (context 256 + drafts > rope table)
MAX_BODY_BYTES = 64 * 1024
FUZZ_EXAMPLES = 150
GREEDY = dict(temperature=0, max_tokens=8)


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    corpus_dir: Path
    state_path: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("server")
    corpus_dir = root / "corpora"
    corpus_dir.mkdir()
    port = _free_port()
    log_path = root / "server.log"
    # A fixed (flat) verify cost: drafting must not depend on how busy the machine is.
    cmd = [sys.executable, "-m", "ngramspec", "serve", "--speculative", "ngram",
           "--verify-cost", "flat",
           "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
           "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
           "--corpus-dir", str(corpus_dir), "--corpus-state", str(root / "learned.ngt"),
           "--max-body-bytes", str(MAX_BODY_BYTES), "--shutdown-timeout", "20",
           "--log-level", "warning"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    srv = Server(f"http://127.0.0.1:{port}", process, corpus_dir, root / "learned.ngt", log_path)
    yield srv
    if process.poll() is None:
        process.kill()
        process.wait()


def _wait_ready(srv: Server, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.process.poll() is None, f"server exited:\n{srv.log()}"
        try:
            if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not ready after {timeout}s:\n{srv.log()}")


@pytest.fixture(scope="module")
def llm(server: Server) -> LLM:
    # Built while the server subprocess loads its own copy.
    return LLM(num_threads=1, max_model_len=MAX_MODEL_LEN)


CONCURRENT_PROMPTS = [f"Tell me one fact about the number {i}." for i in range(32)]


@pytest.fixture(scope="module")
def sequential_outputs(server: Server, llm: LLM) -> list[str]:
    """Greedy chat outputs of CONCURRENT_PROMPTS, one at a time (while the server starts)."""
    return [_chat_reference(llm, p, temperature=0, max_tokens=6) for p in CONCURRENT_PROMPTS]


@pytest.fixture(scope="module")
def live(server: Server, llm: LLM, sequential_outputs: list[str]) -> Server:
    _wait_ready(server)
    return server


@pytest.fixture(scope="module")
def client(live: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(live: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _reference(llm: LLM, prompt: str, **params) -> str:
    return llm.generate(prompt, SamplingParams(**params))[0].text


def _chat_reference(llm: LLM, content: str, **params) -> str:
    return llm.chat([{"role": "user", "content": content}], SamplingParams(**params))[0].text


# ---- OpenAI routes ---------------------------------------------------------------------------

def test_models_and_health(client: openai.OpenAI, live: Server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(live.url + "/health").json()  # no key needed
    assert health["status"] == "ok" and health["kv_free"] == health["kv_usable"] > 0


def test_completion_matches_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "The capital of France is"
    expected = _reference(llm, prompt, **GREEDY)
    resp = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert resp.choices[0].text == expected
    assert resp.usage.prompt_tokens == len(llm.encode(prompt))
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"
    spec = resp.model_extra["speculation"]
    # The first token comes from prefill, the other 7 from verify steps of one or more each.
    assert 1 <= spec["verify_steps"] <= 7
    assert spec["verify_steps"] * spec["mean_acceptance_length"] >= 7 - 1e-9
    stream = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_matches_llm_chat(client: openai.OpenAI, llm: LLM) -> None:
    content = "Name three colours."
    expected = _chat_reference(llm, content, **GREEDY)
    messages = [{"role": "user", "content": content}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected


def _logprob_rows(entries) -> list[tuple[str, float, list[str]]]:
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries]


def test_chat_logprobs_equal_plain_streamed_or_not_spec_on_or_off(client: openai.OpenAI,
                                                                  llm: LLM) -> None:
    """The server speculates; `llm` decodes plainly: same tokens, logprobs within 1e-4."""
    messages = [{"role": "user", "content": "Name three colours."}]
    ref = llm.chat(messages, SamplingParams(**GREEDY, logprobs=3))[0]
    text = llm.tokenizer.decode
    expected = [(text([e.token_id]), e.logprob, [text([t]) for t, _ in e.top]) for e in ref.logprobs]
    for spec in (True, False):
        kw = dict(model=MODEL, messages=messages, logprobs=True, top_logprobs=3,
                  extra_body={"ngram": {"enabled": spec}}, **GREEDY)
        resp = client.chat.completions.create(**kw)
        assert resp.choices[0].message.content == ref.text
        streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                    if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        for got in (_logprob_rows(resp.choices[0].logprobs.content), _logprob_rows(streamed)):
            assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in expected]
            assert all(abs(a - b) <= 1e-4 for (_, a, _), (_, b, _) in zip(got, expected))


def test_completion_logprobs_list_every_token(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "The capital of France is"
    ref = llm.generate(prompt, SamplingParams(**GREEDY, logprobs=2))[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **GREEDY)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text == ref.text
    assert all(abs(a - e.logprob) <= 1e-4 for a, e in zip(lp.token_logprobs, ref.logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
               for i, top in enumerate(lp.top_logprobs))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, logprobs=2, stream=True,
                                            **GREEDY))
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_completion_echo_returns_the_prompt_and_its_logprobs(client: openai.OpenAI,
                                                             llm: LLM) -> None:
    prompt = "The capital of France is"
    n = len(llm.encode(prompt))
    ref = llm.generate(prompt, SamplingParams(**GREEDY, logprobs=1, prompt_logprobs=1))[0]
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, **GREEDY)
    choice = client.completions.create(**kw).choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == n + len(ref.token_ids)
    assert all(abs(a - e.logprob) <= 1e-4
               for a, e in zip(lp.token_logprobs[1:], ref.prompt_logprobs + ref.logprobs))
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(lp.token_logprobs)
    plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, **GREEDY).choices[0]
    assert plain.text == choice.text and plain.logprobs is None


def test_stop_string_is_never_streamed(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    full = _reference(llm, prompt, temperature=0, max_tokens=12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # cuts mid-output, maybe mid-token
    expected = _reference(llm, prompt, temperature=0, max_tokens=12, stop=[stop])
    assert len(expected) < len(full)
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                     stop=stop)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_32_concurrent_streams_equal_sequential(live: Server,
                                                sequential_outputs: list[str]) -> None:
    prompts, expected = CONCURRENT_PROMPTS, sequential_outputs

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=6, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0,
                                     timeout=300)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == expected


def test_references_feed_the_drafter(http: httpx.Client, llm: LLM) -> None:
    prompt = "Write a sentence about a red fox."
    answer = _reference(llm, prompt, temperature=0, max_tokens=16)

    def accepted(reference: list[str] | None) -> int:
        assert http.post("/v1/learned/flush").status_code == 200  # nothing learned across runs
        body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 16}
        if reference is not None:
            body["ngram"] = {"reference": reference}
        resp = http.post("/v1/completions", json=body).json()
        assert resp["choices"][0]["text"] == answer  # hints never change the output
        return resp["speculation"]["accepted_tokens"]

    # The reference holds the whole answer, so nearly every drafted token is right.
    with_reference = accepted([prompt + answer])
    assert with_reference >= 8 > accepted(None)


# ---- bad input -------------------------------------------------------------------------------

LONG_PROMPT = "word " * (MAX_MODEL_LEN + 20)
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}

DEEP_SCHEMA: dict = {"type": "integer"}
for _ in range(200):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}, "required": ["a"]}
BAD_REQUESTS = [
    # (route, raw body or JSON, status, param the error names)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": True}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400,
     "messages.0.content"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -0.5}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 65}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 2, "stream": True}, 400,
     "best_of"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/model.gguf"}, 400, "model_path"),
    ("/update_weights_from_disk", {}, 400, "model_path"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 1,
                         "logprobs_mode": "raw_logits"}, 400, "logprobs_mode"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "tools": [WEATHER], "tool_choice": {
                                  "type": "function", "function": {"name": "nope"}}}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "objectx"}}}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_regex": "[a-"}, 400,
     "guided_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_grammar": "root ::= (("}, 400,
     "guided_grammar"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_choice": []}, 400,
     "guided_choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_json": "{not json"}, 400,
     "guided_json"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_regex": "a",
                         "structured_outputs": {"choice": ["a"]}}, 400, "guided_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "structured_outputs": {"regexp": "a"}},
     400, "structured_outputs.regexp"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_json": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, 400, "guided_json"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_json": DEEP_SCHEMA}, 400,
     "guided_json"),  # pathological: nested 200 deep
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),  # 2nd empty
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1]]}, 400, "prompt"),  # mixed kinds
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400,
     "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "ngram": {"refrence": "x"}}, 400,
     "ngram.refrence"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * MAX_BODY_BYTES}, 413, None),
    ("/v1/completions", b'{"model": "x", "prompt": "a", "temperature": NaN}', 400, None),
]


@pytest.mark.parametrize("route,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{r[2]}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_openai_error(http: httpx.Client, route: str, body, status: int,
                                     param: str | None) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = http.post(route, **kw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "user": "u1", "made_up": [1],
            "metadata": {"a": "b"}, "n": 1, "logprobs": None, "echo": False}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 2


def test_oversized_chunked_body_is_refused(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count streamed bytes
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    resp = http.post("/v1/completions", content=chunks())
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


# ---- security --------------------------------------------------------------------------------

V1_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/corpora"), ("POST", "/v1/corpora"), ("DELETE", "/v1/corpora/x"),
             ("GET", "/v1/learned"), ("POST", "/v1/learned/save"),
             ("POST", "/v1/learned/restore"), ("POST", "/v1/learned/flush"),
             ("GET", "/v1/models/" + MODEL), ("POST", "/tokenize"), ("POST", "/detokenize")]


def test_api_key_guards_every_v1_route(live: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in V1_ROUTES:
            resp = httpx.request(method, live.url + path, headers=headers, json={})
            assert resp.status_code == 401, (method, path, headers)
            assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()


def _corpus(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/corpora", json=body)


def test_corpus_paths_stay_inside_corpus_dir(http: httpx.Client, live: Server,
                                             tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret text")
    d = live.corpus_dir
    (d / "escape.txt").symlink_to(secret)
    (d / "sub").mkdir()
    (d / "sub" / "ok.txt").write_text("fine text")
    (d / "sub" / "leak.txt").symlink_to(secret)  # a directory with one escaping file
    (d / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    for path in (str(secret), "../" * 8 + str(secret).lstrip("/"), "escape.txt", "sub",
                 "linkdir/secret.txt", "sub/../../secret.txt"):
        resp = _corpus(http, name="leak", path=path)
        assert resp.status_code == 403, (path, resp.text)
        assert resp.json()["error"]["code"] == "path_outside_corpus_dir"
    assert _corpus(http, name="leak", path="sub/*.txt").status_code == 400  # no patterns
    assert _corpus(http, name="leak", path="missing.txt").status_code == 404
    assert "leak" not in [c["name"] for c in http.get("/v1/corpora").json()["data"]]


def test_corrupt_corpus_files_are_refused(http: httpx.Client, live: Server) -> None:
    (live.corpus_dir / "bad.ngc").write_bytes(b"NGSPEC\x00\x01 truncated")
    (live.corpus_dir / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    (live.corpus_dir / "bin.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    for name, path in (("c1", "bad.ngc"), ("c2", "bad.jsonl"), ("c3", "bin.txt")):
        resp = _corpus(http, name=name, path=path)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_corpus"
        assert http.delete(f"/v1/corpora/{name}").status_code == 200  # drop the failure record
    assert http.get("/health").json()["status"] == "ok"


def test_corpus_add_list_remove(http: httpx.Client, live: Server, client: openai.OpenAI,
                                llm: LLM) -> None:
    (live.corpus_dir / "docs.jsonl").write_text('{"text": "alpha beta gamma"}\n"delta epsilon"\n')
    resp = _corpus(http, name="files", path="docs.jsonl")
    assert resp.status_code == 201, resp.text
    expected_tokens = len(llm.encode("alpha beta gamma")) + 1 + len(llm.encode("delta epsilon"))
    assert resp.json()["num_tokens"] == expected_tokens  # +1: the document separator
    resp = _corpus(http, name="docs", documents=["The fox jumps over the lazy dog."] * 3,
                   wait=False)
    assert resp.status_code == 202
    assert _corpus(http, name="files", documents=["x"]).status_code == 409
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = {c["name"]: c for c in http.get("/v1/corpora").json()["data"]}
        if listed["docs"]["status"] == "ready":
            break
        time.sleep(0.1)
    assert listed["files"]["num_tokens"] == expected_tokens
    assert listed["docs"]["status"] == "ready" and listed["docs"]["num_tokens"] > 0
    # Generation with corpora loaded is still exact.
    prompt = "The fox jumps"
    assert client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text == \
        _reference(llm, prompt, **GREEDY)
    for name in ("files", "docs"):
        assert http.delete(f"/v1/corpora/{name}").status_code == 200
    assert http.delete("/v1/corpora/docs").status_code == 404
    assert http.get("/v1/corpora").json()["data"] == []


def test_learned_corpus_save_flush_restore(http: httpx.Client, client: openai.OpenAI,
                                           live: Server) -> None:
    client.completions.create(model=MODEL, prompt="One two three four", max_tokens=4)
    before = http.get("/v1/learned").json()["num_nodes"]
    assert before > 1
    saved = http.post("/v1/learned/save", json={"path": "state/learned.ngt"}).json()
    assert saved["num_nodes"] == before and (live.corpus_dir / "state" / "learned.ngt").is_file()
    assert http.post("/v1/learned/flush").status_code == 200
    assert http.get("/v1/learned").json()["num_nodes"] == 1  # the root alone
    restored = http.post("/v1/learned/restore", json={"path": "state/learned.ngt"}).json()
    assert restored["num_nodes"] == before == http.get("/v1/learned").json()["num_nodes"]
    assert http.post("/v1/learned/save", json={"path": "../out.ngt"}).status_code == 403
    (live.corpus_dir / "junk.ngt").write_bytes(b"junk")
    resp = http.post("/v1/learned/restore", json={"path": "junk.ngt"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_state_file"


# ---- structured outputs and tool calls -----------------------------------------------------------

EXTRACT = [{"role": "user", "content": "Marie Curie was 66 years old. Reply with JSON giving "
                                       "her name and age."}]


def _chat_variants(client: openai.OpenAI, **kw) -> list[tuple[str | None, list, str]]:
    """(content, [(name, arguments)], finish_reason) for speculation on/off x streamed or not."""
    out, extra = [], kw.pop("extra_body", {})
    for spec in (True, False):
        args = dict(model=MODEL, extra_body={**extra, "ngram": {"enabled": spec}}, **kw)
        resp = client.chat.completions.create(**args)
        msg = resp.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        out.append((msg.content, calls, resp.choices[0].finish_reason))
        content, calls, reason = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **args):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:  # accumulate as the openai client's helpers do
                name, arguments = calls.get(c.index, ("", ""))
                calls[c.index] = (name + (c.function.name or ""),
                                  arguments + (c.function.arguments or ""))
            reason = chunk.choices[0].finish_reason or reason
        out.append((content.strip() or None, [calls[i] for i in sorted(calls)], reason))
    return out


def test_structured_outputs_equal_plain_decoding(client: openai.OpenAI, llm: LLM) -> None:
    """response_format json_schema / json_object and vLLM's choice, regex and grammar: the server
    (speculating, or not) equals offline plain constrained decoding, streamed or not."""
    from ngramspec.structured.params import StructuredOutputsParams as S

    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "person", "schema": PERSON}}}, S(json=PERSON)),
        ({"response_format": {"type": "json_object"}}, S(json_object=True)),
        ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, S(choice=("yes", "no"))),
        ({"extra_body": {"guided_regex": "[0-9]{2} years"}}, S(regex="[0-9]{2} years")),
        ({"extra_body": {"guided_grammar": 'root ::= "Age: " [0-9]+ "."'}},
         S(grammar='root ::= "Age: " [0-9]+ "."')),
    ]
    import jsonschema

    for kw, spec in cases:
        ref = llm.chat(EXTRACT, SamplingParams(temperature=0, max_tokens=40,
                                               structured_outputs=spec))[0]
        assert ref.finish_reason == "stop", (spec, ref.text)
        variants = _chat_variants(client, messages=EXTRACT, temperature=0, max_tokens=40, **kw)
        assert variants == [(ref.text, [], "stop")] * 4, spec
        if spec.json is not None:
            jsonschema.validate(json.loads(ref.text), PERSON)


def test_completions_take_structured_outputs(client: openai.OpenAI, llm: LLM) -> None:
    from ngramspec.structured.params import StructuredOutputsParams as S

    prompt = "The phone number of the office is"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                              structured_outputs=S(regex=r" \d{3}-\d{4}")))[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20,
                                     extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice, reason", [
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ("required", "tool_calls"),
])
def test_constrained_tool_calls_are_valid_and_equal_plain(client: openai.OpenAI, tool_choice,
                                                          reason) -> None:
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    variants = _chat_variants(client, messages=messages, tools=[WEATHER, ADD],
                              tool_choice=tool_choice, parallel_tool_calls=False,
                              temperature=0, max_tokens=80)
    assert all(v == variants[0] for v in variants), variants
    content, calls, finish = variants[0]
    assert finish == reason and content is None and len(calls) == 1
    name, arguments = calls[0]
    schema = {"get_weather": WEATHER, "add": ADD}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)
    if isinstance(tool_choice, dict):
        assert name == "get_weather"
    # the call as the client holds it goes back with its result, and the conversation goes on
    call = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, ADD], tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0, max_tokens=80).choices[0].message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == calls[0]
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    reply = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, ADD],
                                           tool_choice="none", **GREEDY).choices[0]
    assert reply.message.content and reply.message.tool_calls is None


def test_auto_tool_calls_parse_the_models_format_and_results_go_back(client: openai.OpenAI,
                                                                    llm: LLM) -> None:
    """auto: the Hermes prompt (SmolLM2's template has no tools), the model's own text parsed;
    a conversation with an earlier call and its result renders and runs."""
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    variants = _chat_variants(client, messages=messages, tools=[WEATHER, ADD], temperature=0,
                              max_tokens=30)
    assert all(v == variants[0] for v in variants), variants
    from ngramspec.server.tool_calls import render_messages

    prompt = llm.apply_chat_template(render_messages(
        [{"role": m["role"], "content": m["content"] or "",
          **({"tool_calls": m["tool_calls"]} if "tool_calls" in m else {})} for m in messages],
        [WEATHER, ADD], knows_tools=False))
    text = llm.tokenizer.decode(prompt)
    assert "<tools>" in text and '"name": "add", "arguments": {"a": 2, "b": 3}' in text
    assert "<tool_response>\n5\n</tool_response>" in text


def test_many_structured_requests_at_once_all_validate(client: openai.OpenAI) -> None:
    """Concurrent constrained requests over several schemas, speculation on: every output parses
    and validates, and nothing fails (the full 200-request run is `bench structured`)."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from ngramspec.bench.structured_workloads import SCHEMAS, extraction_prompt

    def one(i: int) -> tuple[dict, str, str]:
        name, schema = SCHEMAS[i % len(SCHEMAS)]
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": extraction_prompt(name, i)}],
            temperature=0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        return schema, resp.choices[0].message.content, resp.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(2 * len(SCHEMAS))))
    for schema, text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


# ---- n > 1, best_of, weight updates, cache flush --------------------------------------------------

def test_n_choices_are_seeded_and_streamed_like_the_body(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    kw = dict(model=MODEL, messages=messages, n=3, temperature=1.0, seed=5, max_tokens=10)
    resp = client.chat.completions.create(**kw)
    texts = [c.message.content for c in resp.choices]
    assert [c.index for c in resp.choices] == [0, 1, 2] and len(set(texts)) > 1
    # choice i samples as the request with seed + i
    refs = [llm.chat(messages, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=10))[0]
            for i in range(3)]
    assert texts == [r.text for r in refs]
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert resp.usage.prompt_tokens == len(refs[0].prompt_token_ids)  # counted once
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_best_of_returns_the_most_likely_candidate(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="My favourite colour is", temperature=1.0, seed=9,
              max_tokens=6)
    candidates = client.completions.create(n=3, logprobs=0, **kw).choices
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(n=1, best_of=3, **kw).choices
    assert len(best) == 1 and best[0].logprobs is None
    assert best[0].text == candidates[scores.index(max(scores))].text


def test_flush_cache_and_update_weights_from_disk(http: httpx.Client, llm: LLM) -> None:
    from ngramspec.models.loader import default_model_path

    prompt = "The capital of France is"
    expected = _reference(llm, prompt, **GREEDY)
    body = {"model": MODEL, "prompt": prompt, **GREEDY}
    _wait_idle(http)  # an earlier test's aborted requests may still be finishing (and caching)
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
    assert http.get("/health").json()["kv_cached"] > 0
    flushed = http.post("/flush_cache").json()
    assert flushed["success"] and flushed["freed_slots"] > 0
    assert http.get("/health").json()["kv_cached"] == 0
    resp = http.post("/update_weights_from_disk", json={"model_path": str(default_model_path())})
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected


def test_weight_update_under_load_fails_no_request(live: Server, http: httpx.Client) -> None:
    """Requests in flight during an update finish normally (their K/V recomputed)."""
    from concurrent.futures import ThreadPoolExecutor

    from ngramspec.models.loader import default_model_path

    def one(i: int) -> tuple[int, str | None]:
        with httpx.Client(base_url=live.url, timeout=300,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"Story {i}:",
                                                "max_tokens": 40, "temperature": 0,
                                                "ignore_eos": True})
            return r.status_code, r.json()["choices"][0]["finish_reason"] if r.is_success \
                else None

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(1.0)
        update = http.post("/update_weights_from_disk",
                           json={"model_path": str(default_model_path())})
        results = [f.result() for f in futures]
    assert update.status_code == 200, update.text
    assert results == [(200, "length")] * 8


def test_admin_routes_need_the_key(live: Server) -> None:
    for path in ("/flush_cache", "/update_weights_from_disk"):
        assert httpx.post(live.url + path, json={}).status_code == 401


# ---- fuzzing ---------------------------------------------------------------------------------

_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                  st.lists(st.integers(-5, 70000), max_size=5),
                  st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values, so many bodies get past validation."""
    return st.integers(0, 14).flatmap(lambda i: _JUNK if i == 0 else valid)


_MESSAGE = st.fixed_dictionaries({
    "role": _mostly(st.sampled_from(["user", "system", "assistant", "developer"])),
    "content": _mostly(st.text(max_size=20))})
_COMMON = {
    "temperature": _mostly(st.floats(0, 2)),
    "top_p": _mostly(st.floats(0.01, 1)),
    "top_k": _mostly(st.integers(-1, 100)),
    "stop": _mostly(st.one_of(st.text(min_size=1, max_size=4),
                              st.lists(st.text(min_size=1, max_size=4), max_size=4))),
    "seed": _mostly(st.integers(-2**63, 2**63 - 1)),
    "n": _mostly(st.integers(1, 3)),
    "presence_penalty": _mostly(st.floats(-2, 2)),
    "frequency_penalty": _mostly(st.floats(-2, 2)),
    "repetition_penalty": _mostly(st.floats(0.5, 2)),
    "stream": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ngram": _mostly(st.fixed_dictionaries({}, optional={"reference": st.one_of(
        st.text(max_size=30), st.lists(st.text(max_size=30), max_size=3)),
        "enabled": st.booleans()})),
    "logit_bias": st.one_of(st.just({}), _JUNK),
    "some_unknown_field": _JUNK,
    "guided_regex": _mostly(st.text(max_size=8)),  # often not a valid regex
    "guided_choice": _mostly(st.lists(st.text(max_size=4), max_size=3)),
    "response_format": _mostly(st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("x"), "schema": st.one_of(st.just(PERSON), st.dictionaries(
                st.sampled_from(["type", "enum", "properties", "pattern", "minimum"]), _JUNK,
                max_size=3))})}))),
}
# max_tokens is always there and tiny (or junk), so a valid case costs one or two engine steps.
_REQUIRED = {"model": _mostly(st.just(MODEL)), "max_tokens": _mostly(st.integers(1, 2))}
_TOOLS = {
    "tools": _mostly(st.lists(st.one_of(st.just(WEATHER), st.just(ADD)), max_size=2)),
    "tool_choice": _mostly(st.one_of(st.sampled_from(["none", "auto", "required"]), st.just(
        {"type": "function", "function": {"name": "get_weather"}}))),
}
_BODIES = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {**_REQUIRED, "prompt": _mostly(st.one_of(st.text(max_size=30),
                                                  st.lists(st.integers(0, 49151), max_size=6),
                                                  st.lists(st.text(max_size=10), min_size=1,
                                                           max_size=3)))},
        optional=_COMMON)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {**_REQUIRED, "messages": _mostly(st.lists(_MESSAGE, max_size=3))},
        optional={**_COMMON, **_TOOLS})),
)


def test_fuzzed_bodies_never_break_the_server(http: httpx.Client) -> None:
    seen: list[int] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_BODIES)
    def check(case: tuple[str, dict]) -> None:
        route, body = case
        resp = http.post(route, json=body)
        seen.append(resp.status_code)
        assert resp.status_code in (200, 400, 404), (body, resp.text)
        if resp.status_code != 200:
            assert resp.json()["error"]["message"]
        elif body.get("stream") is True:
            assert resp.text.rstrip().endswith("data: [DONE]")
        else:
            prompt = body.get("prompt")
            several = isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
            prompts = len(prompt) if several else 1
            assert len(resp.json()["choices"]) == (body.get("n") or 1) * prompts

    check()
    print(f"\nfuzz: {len(seen)} cases, status counts "
          f"{ {s: seen.count(s) for s in sorted(set(seen))} }")
    assert len(seen) >= FUZZ_EXAMPLES
    assert seen.count(200) >= 5  # the fuzzer does reach generation (typically 15-30%)
    assert http.get("/health").json()["status"] == "ok"


# ---- disconnects, metrics, shutdown -----------------------------------------------------------

def _wait_idle(http: httpx.Client, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = http.get("/health").json()
        if health["running"] == health["waiting"] == health["in_flight"] == 0:
            return health
        time.sleep(0.2)
    raise AssertionError(f"server still busy: {health}")


def test_100_aborted_streams_free_the_kv_pool(http: httpx.Client, live: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def abort_one(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 200,
                "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            if i % 4 == 0:
                return False  # leave before any token
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return True  # leave after the first chunk
        raise AssertionError("the stream ended before its first chunk")

    async def run_all() -> list[bool]:
        async with httpx.AsyncClient(base_url=live.url, headers=headers, timeout=300) as client:
            return await asyncio.gather(*(abort_one(client, i) for i in range(100)))

    started = asyncio.run(run_all())
    assert sum(started) == 75
    health = _wait_idle(http)
    assert health["kv_free"] == health["kv_usable"]


def test_non_streaming_disconnect_aborts(http: httpx.Client, live: Server) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    t0 = time.monotonic()
    health = _wait_idle(http, timeout=60)
    assert health["kv_free"] == health["kv_usable"]
    assert time.monotonic() - t0 < 30  # far less than 200 tokens would take


def test_metrics_report_the_traffic(live: Server) -> None:
    text = httpx.get(live.url + "/metrics").text  # open, like /health
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in ("ngramspec_generation_tokens_total", "ngramspec_prompt_tokens_total",
                 "ngramspec_time_to_first_token_seconds_count",
                 "ngramspec_inter_token_latency_seconds_count",
                 "ngramspec_acceptance_length_count", "ngramspec_draft_time_seconds_count",
                 "ngramspec_verify_time_seconds_count", "ngramspec_spec_draft_tokens_total"):
        assert values[name] > 0, name
    assert values["ngramspec_spec_draft_failures_total"] == 0.0  # exported, and none here
    assert values["ngramspec_kv_cache_usage_ratio"] == 0.0
    assert values["ngramspec_num_requests_waiting"] == 0.0
    assert values['ngramspec_requests_total{code="401",route="/v1/models"}'] >= 3
    assert values['ngramspec_request_finished_total{finish_reason="length"}'] > 0


# ---- vLLM drop-in: several prompts per call, /tokenize, metrics with vLLM's names ------------

def test_a_list_of_prompts_equals_one_request_per_prompt(client: openai.OpenAI, llm: LLM) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    expected = [_reference(llm, p, **GREEDY) for p in prompts]
    singles = [client.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts]
    assert [s.choices[0].text for s in singles] == expected
    for prompt in (prompts, [llm.encode(p) for p in prompts]):  # text or token ids
        resp = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert [(c.index, c.text) for c in resp.choices] == list(enumerate(expected))
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert getattr(resp.usage, key) == sum(getattr(s.usage, key) for s in singles)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == expected
    # n choices per prompt, indexed prompt-major (OpenAI's order); choice i samples with seed + i
    kw = {"model": MODEL, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 6}
    each = [[c.text for c in client.completions.create(prompt=p, **kw).choices]
            for p in prompts[:2]]
    both = client.completions.create(prompt=prompts[:2], **kw).choices
    assert [c.index for c in both] == [0, 1, 2, 3]
    assert [c.text for c in both] == each[0] + each[1]


def test_tokenize_matches_the_chat_prompt_and_round_trips(http: httpx.Client, llm: LLM,
                                                           client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    expected = llm.chat(messages, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert tokens["tokens"] == list(expected) and tokens["count"] == len(expected)
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == tokens["count"]
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                          max_tokens=1)
    assert chat.usage.prompt_tokens == with_tools["count"] > tokens["count"]
    text = "Tokenise me, then back: 12345 🙂"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert ids == llm.encode(text)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}


def test_vllm_metrics_after_speculative_requests(http: httpx.Client, live: Server) -> None:
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2,",
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["speculation"]["accepted_tokens"] > 0
    _wait_idle(http)
    text = httpx.get(live.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = f'{{model_name="{MODEL}"}}'

    def vllm(name: str) -> float:
        return values["vllm:" + name + label]

    drafts, drafted = vllm("spec_decode_num_drafts_total"), \
        vllm("spec_decode_num_draft_tokens_total")
    accepted = vllm("spec_decode_num_accepted_tokens_total")
    per_pos = []
    while (key := "vllm:spec_decode_num_accepted_tokens_per_pos_total"
           f'{{model_name="{MODEL}",position="{len(per_pos)}"}}') in values:
        per_pos.append(values[key])
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    assert per_pos and per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    assert sum(per_pos) == accepted
    assert accepted == values["ngramspec_spec_accepted_tokens_total"]
    assert drafted == values["ngramspec_spec_draft_tokens_total"]
    assert vllm("prompt_tokens_total") == values["ngramspec_prompt_tokens_total"]
    assert vllm("generation_tokens_total") == values["ngramspec_generation_tokens_total"]
    assert vllm("time_to_first_token_seconds_count") > 0
    assert vllm("e2e_request_latency_seconds_count") > 0
    assert vllm("num_requests_running") == 0 and vllm("num_requests_waiting") == 0
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert values[success] > 0


# ---- vLLM's request fields -------------------------------------------------------------------

def test_openai_client_nulls_mean_defaults(client: openai.OpenAI, http: httpx.Client,
                                           llm: LLM) -> None:
    """The openai client sends an explicit None as null: the field's default."""
    prompt = "The capital of France is"
    nulls = {name: None for name in ("top_p", "n", "presence_penalty", "frequency_penalty",
                                     "stop", "seed", "logit_bias", "stream", "user")}
    resp = client.completions.create(model=MODEL, prompt=prompt, logprobs=None, echo=None,
                                      best_of=None, suffix=None, **nulls, **GREEDY)
    assert resp.choices[0].text == _reference(llm, prompt, **GREEDY)
    messages = [{"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, logprobs=None,
                                           top_logprobs=None, max_completion_tokens=None,
                                           **nulls, **GREEDY)
    assert resp.choices[0].message.content == _chat_reference(llm, messages[0]["content"],
                                                              **GREEDY)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": None,
            "top_k": None, "min_p": None, "repetition_penalty": None, "stop_token_ids": None}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_vllm_sampling_fields_equal_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    """min_tokens, logit_bias, stop_token_ids and include_stop_str_in_output, streamed or not,
    as the offline LLM with the same SamplingParams (the server speculates, llm does not)."""
    prompt = "Count along: 1, 2, 3, 5, 8, 13, 21,"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    full = plain.text
    stop = full[4:7]
    cases = [  # (SamplingParams fields, request fields)
        ({"logit_bias": {plain.token_ids[1]: -100.0, plain.token_ids[5]: 3.0}, "min_tokens": 4,
          "stop_token_ids": [plain.token_ids[6]]},
         {"logit_bias": {str(plain.token_ids[1]): -100, str(plain.token_ids[5]): 3},
          "extra_body": {"min_tokens": 4, "stop_token_ids": [plain.token_ids[6]]}}),
        ({"stop": [stop], "include_stop_str_in_output": True},
         {"stop": [stop], "extra_body": {"include_stop_str_in_output": True}}),
    ]
    for fields, request in cases:
        ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, **fields))[0]
        kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, **request)
        resp = client.completions.create(**kw)
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (ref.text,
                                                                         ref.finish_reason)
        assert resp.usage.completion_tokens == len(ref.token_ids)
        streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kw)
                    if c.choices]
        assert "".join(streamed) == ref.text
    assert ref.text.endswith(stop) and ref.finish_reason == "stop"


def test_vllm_chat_fields_equal_llm(client: openai.OpenAI, llm: LLM) -> None:
    """min_tokens past the model's EOS, skip_special_tokens=False, the template fields."""
    messages = [{"role": "user", "content": "Say only the word: yes"}]
    short = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    assert short.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=len(short.token_ids) + 3,
                            skip_special_tokens=False)
    ref = llm.chat(messages, params)[0]
    assert len(ref.token_ids) > len(short.token_ids)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24,
        extra_body={"min_tokens": params.min_tokens, "skip_special_tokens": False,
                    "chat_template_kwargs": {"custom_variable": 1}})
    assert resp.choices[0].message.content == ref.text
    if ref.finish_reason == "stop":  # the EOS stays in the text
        assert ref.text.endswith(llm.tokenizer.decode(ref.token_ids[-1:]))
    tok = llm.tokenizer
    prefill = messages + [{"role": "assistant", "content": "The answer is"}]
    for extra, template in (
            ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
            ({"continue_final_message": True},
             {"add_generation_prompt": False, "continue_final_message": True})):
        conversation = prefill if "continue_final_message" in extra else messages
        ids = tok.apply_chat_template(conversation, tokenize=True, **template)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        expected = llm.generate(ids, SamplingParams(**GREEDY))[0].text
        resp = client.chat.completions.create(model=MODEL, messages=conversation,
                                              extra_body=extra, **GREEDY)
        assert resp.choices[0].message.content == expected, extra


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"priority": 3}, "priority"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"spaces_between_special_tokens": False},
     "spaces_between_special_tokens"),
])
def test_vllm_fields_we_cannot_honour_are_400s(http: httpx.Client, route: str, body: dict,
                                               param: str) -> None:
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"prompt": "Hi"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    resp = http.post(route, json=base | body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    nothing = {k: {True: False, 3: 0, 5: None, False: True}[v] for k, v in body.items()}
    assert http.post(route, json=base | nothing).status_code == 200


def test_logit_bias_outside_the_vocabulary_is_a_400(http: httpx.Client) -> None:
    for body, param in (({"logit_bias": {"99999999": 1}}, "logit_bias"),
                        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                        ({"logit_bias": {"5": 150}}, "logit_bias.5")):
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                  "max_tokens": 2} | body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


def test_sigterm_finishes_in_flight_and_saves_state(live: Server) -> None:
    """Last: it stops the module's server."""
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        live.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finals = [json.loads(r[6:]) for r in rest[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cancelled
    # uvicorn re-raises the signal once its graceful shutdown is done, as servers should.
    assert live.process.wait(timeout=60) in (0, -signal.SIGTERM), live.log()
    meta, arrays = persist.load(live.state_path, "trie")
    assert meta["trie"]["num_nodes"] > 1 and len(arrays["token"]) == meta["trie"]["num_nodes"]
