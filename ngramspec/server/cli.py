"""`ngramspec serve`: the OpenAI-compatible server (one process: engine thread + uvicorn).

    ngramspec serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--speculative ngram ...]
                    [--api-key KEY] [--corpus-dir DIR] [--corpus FILE ...] [--corpus-state PATH]
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

log = logging.getLogger("ngramspec.server")
API_KEY_ENV = "NGRAMSPEC_API_KEY"


def add_serve_parser(subparsers: Any) -> None:
    from ngramspec.cli_options import add_engine_args

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", default=None, help="the name clients send as model")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (env {API_KEY_ENV})")
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
    p.set_defaults(func=run_serve)


def register(subparsers: Any) -> None:
    """Add `serve` to the main CLI; it sets `func(args) -> int`."""
    add_serve_parser(subparsers)


def configs_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(EngineConfig, ServerSettings); ValueError names a bad option."""
    from ngramspec.cli_options import engine_kwargs_from_args
    from ngramspec.config import EngineConfig
    from ngramspec.server.state import ServerSettings

    config = EngineConfig(**engine_kwargs_from_args(args))
    settings = ServerSettings(
        model_name=args.served_model_name, api_key=args.api_key, corpus_dir=args.corpus_dir,
        corpus_files=list(args.corpus), corpus_state=args.corpus_state,
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
        max_in_flight=args.max_in_flight)
    return config, settings


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ngramspec.server.app import create_app
    from ngramspec.server.state import build_state

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config, settings = configs_from_args(args)
    if not _is_loopback(args.host) and settings.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach it may use it",
                    args.host)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m ngramspec.server.cli serve ...` (the same as `ngramspec serve ...`)."""
    parser = argparse.ArgumentParser(prog="ngramspec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # config validation, corrupt state files: one clear line
        parser.exit(2, f"ngramspec serve: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
