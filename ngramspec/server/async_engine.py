"""AsyncEngine: the engine loop on its own thread, driven from asyncio through a command queue.

LLMEngine is not thread-safe, so only the engine thread touches it. The event loop sends commands
(add, abort, call) through a `queue.Queue`; the engine thread answers with
`loop.call_soon_threadsafe`, so futures and per-request asyncio queues are only ever touched on
the event loop.

`AsyncEngine.build` constructs the engine on the thread that will step it. OpenMP keeps a worker
team per thread that runs parallel regions; with the loading thread's team still alive, libgomp
counts more threads than cores and its workers sleep after ~100 spins instead of waiting hot, so
every kernel of a step pays a wake-up. One thread doing all of the model's work keeps one team.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ngramspec.engine.engine import LLMEngine, StepOutput, choice_id
from ngramspec.engine.logprobs import TokenLogprob
from ngramspec.engine.sequence import Sequence
from ngramspec.sampling_params import SamplingParams

log = logging.getLogger("ngramspec.server")

# A non-streamed request's tokens after its first reach the event loop at most every HOLD_S
# seconds, and at its finish, rather than at every step: each delivery wakes the loop, which then
# takes the GIL from the engine thread. Its first tokens go at once (time to first token), and
# the metrics still see every token within HOLD_S.
HOLD_S = 0.05


@dataclass(slots=True)
class SpecStats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0  # tokens per verify step, bonus included

    @classmethod
    def of(cls, seq: Sequence) -> SpecStats:
        s = seq.spec
        return cls(s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens,
                   s.mean_acceptance_length)


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request; the last event has `finish_reason` (or `error`) set."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_len: int | None = None  # output text is cut here (a stop string matched)
    spec: SpecStats | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, later: TokenEvent) -> TokenEvent:
        """This event and the `later` one as a single event (its finish, if any)."""
        return TokenEvent(self.token_ids + later.token_ids, later.finish_reason, later.stop_text_len,
                          later.spec, later.error, self.logprobs + later.logprobs,
                          self.prompt_logprobs if self.prompt_logprobs is not None
                          else later.prompt_logprobs)


@dataclass(slots=True)
class Held:
    """A non-streamed request's tokens kept back on the engine thread (see HOLD_S)."""

    event: TokenEvent | None = None
    since: float = 0.0
    started: bool = False  # its first tokens went out (the server's time to first token)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state published by the engine thread after every step (read lock-free)."""

    kv_free: int  # free, or held only by the prefix cache (evicted on demand)
    kv_usable: int
    kv_cached: int  # slots the prefix cache holds
    num_running: int
    num_waiting: int
    num_steps: int


class EngineStopped(RuntimeError):
    pass


@dataclass(slots=True)
class RequestStream:
    """The events of one admitted request, in order."""

    request_id: str
    queue: asyncio.Queue[TokenEvent]
    abort: Callable[[str], None]
    finished: bool = False

    async def next(self) -> TokenEvent:
        event = await self.queue.get()
        self.finished = self.finished or event.finished
        return event

    async def events(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            yield await self.next()

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[StepOutput]], None]
                 | None = None) -> None:
        self.engine = engine  # after start(), only the engine thread may use it
        self.on_step = on_step  # runs on the engine thread after every step (metrics)
        self._commands: queue.SimpleQueue[tuple[str, Any, asyncio.Future | None]] = \
            queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}  # event loop only
        self._held: dict[str, Held] = {}  # engine thread only: the non-streamed requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() when `build` made the thread
        self.snapshot = self._snapshot()
        self.accepting = True
        self.failures = 0  # engine steps that raised

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine],
              on_step: Callable[[LLMEngine, list[StepOutput]], None] | None = None) -> AsyncEngine:
        """Run `factory` on a new thread, which then waits for `start()` and steps the engine it
        built (see the module docstring). Raises what `factory` raises."""
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()
        go = threading.Event()

        def main() -> None:
            try:
                bridge = cls(factory(), on_step)
            except BaseException as e:  # noqa: BLE001 (handed to the caller, who re-raises it)
                built.put(e)
                return
            bridge._go = go
            built.put(bridge)
            go.wait()
            if bridge._loop is not None:  # else stopped before it started
                bridge._run()

        thread = threading.Thread(target=main, name="engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            thread.join()
            raise result
        result._thread = thread
        return result

    # ---- event-loop side ----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._go is not None:  # the thread that built the engine steps it
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  references: list[list[int]] | None = None, stream: bool = True) -> RequestStream:
        """Admit a request; raises what LLMEngine.add_request raises (ValueError: bad input).
        The caller must `close()` the stream when done with it (aborts an unfinished request).
        `stream=False`: its events may come several steps' tokens at a time (HOLD_S)."""
        return (await self.add_choices(request_id, prompt_ids, params, references, stream))[0]

    async def add_choices(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          references: list[list[int]] | None = None,
                          stream: bool = True) -> list[RequestStream]:
        """`add` for n >= 1 choices: one stream per choice, in choice order."""
        if not self.accepting or not self.running:
            raise EngineStopped("the server is shutting down")
        ids = [choice_id(request_id, i) for i in range(params.n)]
        if any(rid in self._streams for rid in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        streams = [RequestStream(rid, asyncio.Queue(), self.abort) for rid in ids]
        for each in streams:
            self._streams[each.request_id] = each.queue
        try:
            await self._send("add", (request_id, prompt_ids, params, references,
                                     [] if stream else ids))
        except BaseException:
            # Failed, or cancelled while the engine thread may have added it: abort is a no-op
            # for an unknown id, so always send it.
            for each in streams:
                each.close()
            raise
        return streams

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id, None))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps; returns its result."""
        if not self.running:
            raise EngineStopped("the engine thread is not running")
        return await self._send("call", fn)

    def _send(self, kind: str, payload: Any) -> asyncio.Future:
        assert self._loop is not None
        future = self._loop.create_future()
        self._commands.put((kind, payload, future))
        return future

    async def drain(self, timeout: float) -> int:
        """Stop admitting, wait up to `timeout` s for requests in flight, abort the rest.
        Returns how many were aborted."""
        self.accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for request_id in left:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(TokenEvent(error="the server is shutting down"))
            self.abort(request_id)
        return len(left)

    async def stop(self) -> None:
        self.accepting = False
        if self._thread is None:
            return
        if self._go is not None and not self._go.is_set():  # built, never started
            self._go.set()
        self._commands.put(("stop", None, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _deliver(self, events: list[tuple[str, TokenEvent]]) -> None:
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            stream.put_nowait(event)
            if event.finished:
                del self._streams[request_id]

    def _fail_all(self, message: str) -> None:
        self._deliver([(rid, TokenEvent(error=message)) for rid in list(self._streams)])

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except Exception:  # a bug outside step(): fail loudly instead of hanging every client
            log.exception("the engine thread crashed")
            self.failures += 1
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, "internal error in the engine")
        self._abort_everything()
        self.snapshot = self._snapshot()
        self.engine.close()  # tensor-parallel followers, if any; on this thread, as every call

    def _handle_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload, future = command
            if kind == "stop":
                return False
            self._execute(kind, payload, future)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _execute(self, kind: str, payload: Any, future: asyncio.Future | None) -> None:
        try:
            if kind == "add":
                request_id, prompt_ids, params, references, quiet = payload
                self.engine.add_request(request_id, prompt_ids, params, references)
                self._held.update((rid, Held()) for rid in quiet)
                result = None
            elif kind == "abort":
                self._held.pop(payload, None)
                result = self.engine.abort_request(payload)
            else:
                result = payload(self.engine)
        except Exception as e:  # reported to the caller; the engine keeps serving
            if future is None:
                log.exception("engine command %s failed", kind)
            else:
                self._reply(future, exc=e)
            return
        if future is not None:
            self._reply(future, result=result)
        self.snapshot = self._snapshot()

    def _reply(self, future: asyncio.Future, result: Any = None,
               exc: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():  # the caller was cancelled
                return
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine's state is unknown after a failed step: fail and drop every request.
            log.exception("engine step failed; aborting all requests")
            self.failures += 1
            self._abort_everything()
            self.snapshot = self._snapshot()
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, "internal error in the engine")
            return
        if self.on_step is not None:
            try:
                self.on_step(self.engine, outputs)
            except Exception:  # metrics must never stop generation
                log.exception("on_step hook failed")
        now = time.monotonic()
        events = []
        for out in outputs:
            event = _event(out)
            if out.seq.request_id in self._held:
                event = self._hold(out.seq.request_id, event, now)
            if event is not None:
                events.append((out.seq.request_id, event))
        self.snapshot = self._snapshot()
        if events:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _hold(self, request_id: str, event: TokenEvent, now: float) -> TokenEvent | None:
        """What of a non-streamed request's new event goes out now: everything held so far, at
        its first tokens, its finish, or HOLD_S after the oldest held; else nothing."""
        held = self._held[request_id]
        due = not held.started or (held.event is not None and now - held.since >= HOLD_S)
        if held.event is not None:
            event = held.event.then(event)
        if event.finished:
            del self._held[request_id]
            return event
        if due:
            held.event, held.started = None, True
            return event
        if held.event is None:
            held.since = now
        held.event = event
        return None

    def _abort_everything(self) -> None:
        self._held.clear()
        sched = self.engine.scheduler
        for seq in [*sched.running, *sched.waiting]:
            try:
                self.engine.abort_request(seq.request_id)
            except Exception:
                log.exception("aborting %s failed", seq.request_id)

    def _snapshot(self) -> EngineSnapshot:
        e = self.engine
        cache = e.scheduler.cache
        return EngineSnapshot(e.scheduler.num_available, e.allocator.num_usable,
                              cache.num_nodes if cache is not None else 0,
                              len(e.scheduler.running), len(e.scheduler.waiting),
                              e.stats.num_steps)


def _event(out: StepOutput) -> TokenEvent:
    seq = out.seq
    first = out.new_token_ids and seq.num_output_tokens == len(out.new_token_ids)
    prompt = list(seq.prompt_logprobs) if first and seq.params.prompt_logprobs is not None else None
    if not seq.is_finished:
        return TokenEvent(list(out.new_token_ids), logprobs=list(out.new_logprobs),
                          prompt_logprobs=prompt)
    return TokenEvent(list(out.new_token_ids), seq.finish_reason, seq.stop_text_len,
                      SpecStats.of(seq), logprobs=list(out.new_logprobs), prompt_logprobs=prompt)
