"""`ngramspec serve [MODEL]`: the OpenAI-compatible server (one process: engine thread + uvicorn).

    ngramspec serve [MODEL] [--host 127.0.0.1] [--port 8000] [--speculative ngram ...]
                    [--speculative-config JSON] [--served-model-name NAME [NAME ...]]
                    [--api-key KEY] [--corpus-dir DIR] [--corpus FILE ...] [--corpus-state PATH]

MODEL (or --model): a GGUF file, an HF model directory or an HF model id (org/name) already in
the local HF cache; default: the bundled SmolLM2-135M-Instruct. vLLM's serve options
(--speculative-config, --served-model-name, --chat-template, --allowed-origins,
--tool-call-parser, --enable-auto-tool-choice, --max-model-len, --dtype, --seed) mean the same.
Needs the server's packages: pip install 'ngramspec[serve]'.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
from typing import Any

from ngramspec.cli.engine_args import add_engine_args, engine_kwargs_from_args

log = logging.getLogger("ngramspec.server")
API_KEY_ENV = "NGRAMSPEC_API_KEY"
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "pydantic")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model (as --model; give one or the other)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients send as model: the first is the one /v1/models "
                        "lists first, the rest are aliases (default: the HF id or file name)")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (env {API_KEY_ENV})")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template replacing the model's: a file path or the text")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the tool-call format to parse from outputs (default: the chat "
                        "template's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; tool calls are always parsed when a "
                        "request gives tools")
    g.add_argument("--allowed-origins", type=_origins, default=[], metavar="JSON",
                   help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: no CORS)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed the generators that requests without a seed of their own use")
    g.add_argument("--corpus-dir", default=None,
                   help="the only directory corpus routes may read or write")
    g.add_argument("--corpus", action="append", default=[], metavar="FILE",
                   help="external corpus loaded at start: .ngc, JSONL or text (repeatable)")
    g.add_argument("--corpus-state", default=None, metavar="PATH",
                   help="learned corpus: restored at start if present, saved at clean shutdown")
    g.add_argument("--max-body-bytes", type=int, default=16 << 20)
    g.add_argument("--max-in-flight", type=int, default=1024,
                   help="requests admitted at once; more get 429")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run, requires=[("serve", SERVE_MODULES)])  # checked before run


def _origins(text: str) -> list[str]:
    try:
        origins = json.loads(text)
    except json.JSONDecodeError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a JSON list of origins, e.g. '[\"*\"]' or "
            "'[\"https://example.com\"]'")
    return origins


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model of `serve MODEL` or `--model`; ValueError when both are given and differ."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model "
                         f"{args.model!r}; give one")
    return args.model_tag if args.model_tag is not None else args.model


def served_names(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(main name, aliases): --served-model-name's, else an HF id as given (as vLLM serves it;
    the engine sees its cached path), else None (the server derives it from the path)."""
    if args.served_model_name:
        return args.served_model_name[0], list(args.served_model_name[1:])
    from ngramspec.models.loader import is_hf_model_id

    return (args.model if args.model is not None and is_hf_model_id(args.model) else None), []


def configs_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(EngineConfig, ServerSettings); ValueError names a bad option."""
    from ngramspec.config import EngineConfig
    from ngramspec.server.state import ServerSettings
    from ngramspec.vllm_compat import load_chat_template

    args.model = model_from_args(args)
    name, aliases = served_names(args)  # before EngineConfig replaces an HF id by its path
    config = EngineConfig(**engine_kwargs_from_args(args))
    settings = ServerSettings(
        model_name=name, model_aliases=aliases, api_key=args.api_key,
        corpus_dir=args.corpus_dir, corpus_files=list(args.corpus),
        corpus_state=args.corpus_state, max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout, max_in_flight=args.max_in_flight,
        allowed_origins=list(args.allowed_origins), tool_call_parser=args.tool_call_parser,
        chat_template=load_chat_template(args.chat_template))
    return config, settings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ngramspec.server.app import create_app
    from ngramspec.server.state import build_state
    from ngramspec.vllm_compat import seed_everything

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config, settings = configs_from_args(args)
    if not _is_loopback(args.host) and settings.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach it may use it",
                    args.host)
    if args.seed is not None:
        seed_everything(args.seed)
    state = build_state(config, settings)
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=int(settings.shutdown_timeout) + 1,
                               access_log=args.log_level == "debug")
    server = _make_server(uv_config, on_exit=lambda: setattr(state.engine, "accepting", False))
    server.run()
    return 0


def _make_server(config: Any, on_exit: Any) -> Any:
    """uvicorn's Server, plus: stop admitting the moment SIGTERM/SIGINT arrives (uvicorn only
    stops accepting connections; keep-alive clients could still send new requests)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
