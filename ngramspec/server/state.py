"""ServerSettings (validated) and ServerState: everything the routes share, built once at start."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ngramspec.config import EngineConfig
from ngramspec.corpus.registry import ExternalCorpora
from ngramspec.engine.engine import LLMEngine
from ngramspec.server import learned
from ngramspec.server.async_engine import AsyncEngine
from ngramspec.server.metrics import ServerMetrics
from ngramspec.server.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("ngramspec.server")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class ServerSettings:
    model_name: str | None = None  # served name; None = derived from the model path
    # further names clients may send as `model` (vLLM's --served-model-name takes several)
    model_aliases: list[str] = field(default_factory=list)
    api_key: str | None = None  # every /v1 route needs "Authorization: Bearer <key>"
    corpus_dir: str | None = None  # the only directory routes may read or write
    corpus_files: list[str] = field(default_factory=list)  # loaded at start (.ngc or text)
    corpus_state: str | None = None  # learned corpus: restored at start, saved at shutdown
    max_body_bytes: int = 16 << 20
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish
    max_in_flight: int = 1024  # requests admitted at once; more get 429
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    grammar_compile_timeout: float = 10.0  # seconds; a slower schema or grammar gets a 400
    allowed_origins: list[str] = field(default_factory=list)  # CORS; ["*"] allows any origin
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None: from the template
    chat_template: str | None = None  # Jinja text replacing the model's own; None: the model's

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_in_flight", "completion_default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ServerSettings.{name}={value!r} must be a positive integer")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"ServerSettings.grammar_compile_timeout="
                             f"{self.grammar_compile_timeout!r} must be > 0")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"ServerSettings.shutdown_timeout={self.shutdown_timeout!r} "
                             "must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerSettings.api_key must not be empty")
        if self.corpus_dir is not None and not Path(self.corpus_dir).is_dir():
            raise ValueError(f"ServerSettings.corpus_dir={self.corpus_dir!r} is not a directory")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"ServerSettings.tool_call_parser={self.tool_call_parser!r} is not "
                             f"one of {', '.join(TOOL_CALL_PARSERS)}")

    @property
    def corpus_root(self) -> Path | None:
        return None if self.corpus_dir is None else Path(self.corpus_dir).resolve()


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Any  # decoding, on the event loop (fast tokenizers are not thread-safe)
    encoder: Encoder  # encoding and chat templates, on their own thread
    corpora: ExternalCorpora
    corpus_tokenizer: Any  # the corpus loader thread's own instance
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    corpus_loads: dict[str, asyncio.Future] = field(default_factory=dict)  # name -> load
    corpus_errors: dict[str, str] = field(default_factory=dict)  # failed background loads


class Encoder:
    """Tokenisation off the event loop (a long prompt takes a while), on one thread that owns
    its tokenizer instance."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="encoder")

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def chat(self, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None,
                   add_generation_prompt: bool = True,
                   add_special_tokens: bool = False) -> list[int]:
        """The prompt LLM.apply_chat_template builds, so outputs match LLM.chat; `tools` only
        for a template that renders them (see tool_calls.render_messages); `template_kwargs`
        are extra variables for the template (vLLM's `chat_template_kwargs`).
        `add_special_tokens` (vLLM's /tokenize): the rendered text is encoded with the
        tokenizer's own special tokens (a BOS, for some), which the template may already hold."""
        extra = dict(template_kwargs or {}) | ({"tools": tools} if tools else {})
        if add_special_tokens:
            text = await self._run(self.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt, tokenize=False,
                                   **extra)
            return await self.encode(text, add_special_tokens=True)
        ids = await self._run(self.tokenizer.apply_chat_template, messages,
                              add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def decode(self, ids: list[int]) -> str:
        """Special tokens kept (vLLM's /detokenize): the text encodes back to `ids`."""
        return await self._run(self.tokenizer.decode, ids, skip_special_tokens=False)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def served_model_name(config: EngineConfig, settings: ServerSettings) -> str:
    if settings.model_name:
        return settings.model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model)
    return path.stem if path.suffix == ".gguf" else path.name


def build_state(config: EngineConfig, settings: ServerSettings) -> ServerState:
    """Load the engine, corpora and the learned corpus; slow (seconds), call before serving."""
    corpora = ExternalCorpora(config.drafter.external_corpus_max_tokens, progress=False)

    def make_engine() -> LLMEngine:  # on the engine thread (AsyncEngine.build)
        engine = LLMEngine(config, corpora)  # the drafter reads corpora's snapshots: add any time
        if settings.corpus_state and Path(settings.corpus_state).is_file():
            restore_learned(engine, Path(settings.corpus_state))
        return engine

    metrics = ServerMetrics(max_acceptance_length=config.drafter.draft_token_num,
                            model_name=served_model_name(config, settings),
                            max_model_len=config.max_model_len)
    bridge = AsyncEngine.build(make_engine, metrics.on_step)
    engine = bridge.engine  # read-only here: its thread waits for start()
    if settings.chat_template is not None:  # before the copies below, so every thread sees it
        engine.tokenizer.chat_template = settings.chat_template
    # One tokenizer per thread that uses one (copies are cheap, loading is not).
    corpus_tokenizer = copy.deepcopy(engine.tokenizer)
    for path in settings.corpus_files:
        size = load_corpus_path(corpora, Path(path).stem, [Path(path)], corpus_tokenizer)
        log.info("corpus %s: %d tokens", Path(path).stem, size)
    return ServerState(settings, bridge,
                       copy.deepcopy(engine.tokenizer), Encoder(copy.deepcopy(engine.tokenizer)),
                       corpora, corpus_tokenizer, metrics, served_model_name(config, settings),
                       engine.max_model_len, engine.model_cfg.vocab_size)


def restore_learned(engine: LLMEngine, path: Path) -> None:
    """Before the engine thread starts. A corrupt file stops the start-up (ValueError)."""
    try:
        trie_class = learned.trie_class(engine)
    except learned.NoLearnedCorpus as e:
        log.warning("not restoring --corpus-state %s: %s", path, e)
        return
    trie = learned.read(path, trie_class, learned.max_depth(engine))
    learned.install(engine, trie)
    log.info("restored the learned corpus from %s (%d nodes)", path, trie.num_nodes)


def load_corpus_path(corpora: ExternalCorpora, name: str, files: list[Path],
                     tokenizer: Any) -> int:
    """Synchronous load: a built .ngc file as is, anything else tokenised."""
    if len(files) == 1 and files[0].suffix == ".ngc":
        return corpora.add_built(name, files[0])
    return corpora.add_files(name, files, tokenizer)
