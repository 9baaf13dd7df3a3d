"""The drafter options every command that drafts shares (`add_drafter_args` /
`drafter_config_from_args`), and external corpus files for `simulate` and `bench corpus`.

Every `DrafterConfig` field is an option `--<field-with-dashes>`; SGLang's spellings
(`--speculative-ngram-max-trie-depth`, `--speculative-num-draft-tokens`, ...) are aliases.
Options left out keep the preset's default (SGLang's for `--preset sglang`).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ngramspec.drafting.config import DrafterConfig

DEST_PREFIX = "drafter_"
# SGLang server flags (docs/reference/sglang_ngram.md §4.1) and their historical names, as aliases.
SGLANG_ALIASES = {
    "draft_token_num": ["--speculative-num-draft-tokens"],
    "max_trie_depth": ["--speculative-ngram-max-trie-depth",
                       "--speculative-ngram-branch-length"],
    "min_bfs_breadth": ["--speculative-ngram-min-bfs-breadth"],
    "max_bfs_breadth": ["--speculative-ngram-max-bfs-breadth"],
    "match_type": ["--speculative-ngram-match-type"],
    "capacity": ["--speculative-ngram-capacity"],
    "external_sam_budget": ["--speculative-ngram-external-sam-budget"],
    "external_corpus_max_tokens": ["--speculative-ngram-external-corpus-max-tokens"],
}


def _arg_type(hint: Any) -> Any:
    """The scalar type argparse should parse for a field hint (`X | None` -> X)."""
    if typing.get_origin(hint) is typing.Literal:
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """Add one option per `DrafterConfig` field (and SGLang's aliases) in a "drafter" group."""
    group = parser.add_argument_group("drafter", "n-gram drafter options (DrafterConfig)")
    hints = typing.get_type_hints(DrafterConfig)
    for f in fields(DrafterConfig):
        kind = _arg_type(hints[f.name])
        choices = list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else None
        names = [f"--{f.name.replace('_', '-')}", *SGLANG_ALIASES.get(f.name, [])]
        kw: dict[str, Any] = {"dest": DEST_PREFIX + f.name, "default": None,
                              "help": f"(default: {f.default})"}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = (str.upper if f.name == "match_type" else str) if choices else kind
            kw["metavar"] = None if choices else f.name.upper()
            kw["choices"] = choices
        group.add_argument(*names, **kw)


def drafter_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The DrafterConfig fields given on the command line (options left out are absent)."""
    given = {f.name: getattr(args, DEST_PREFIX + f.name, None) for f in fields(DrafterConfig)}
    return {k: v for k, v in given.items() if v is not None}


def drafter_config(given: dict[str, Any]) -> DrafterConfig:
    """The config of `given` fields on top of their preset; ValueError names a bad field."""
    given = dict(given)
    if given.pop("preset", "ngramspec") == "sglang":
        return DrafterConfig.sglang(**given)
    return DrafterConfig(**given)


def drafter_config_from_args(args: argparse.Namespace) -> DrafterConfig:
    """The config the options ask for; raises ValueError naming a bad field."""
    return drafter_config(drafter_fields_from_args(args))


def load_corpora(paths: list[str], max_tokens: int) -> Any:
    """External corpora built with `ngramspec corpus build`, by file stem; None for none."""
    if not paths:
        return None
    from ngramspec.corpus.registry import ExternalCorpora

    corpora = ExternalCorpora(max_tokens=max_tokens, progress=False)
    for path in paths:
        corpora.add_built(Path(path).stem, path)
    return corpora
