"""vLLM's spellings for what ngramspec already does: `speculative_config`, `chat_template`, `seed`.

Used by `LLM(...)` and the CLI alike, so both accept and reject the same things.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ngramspec.drafting.config import DrafterConfig

# Both of vLLM's model-free methods name what our n-gram drafter does (it matches the request's
# own text, like "ngram", and a global trie of earlier outputs, like "suffix").
NGRAM_METHODS = ("ngram", "suffix")
SPECULATIVE_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max",
                           "prompt_lookup_min")
# vLLM's speculative_config key -> the DrafterConfig field it sets.
_DRAFTER_FIELD = {"num_speculative_tokens": "draft_token_num",
                  "prompt_lookup_max": "max_context_match"}

SPECULATIVE_CONFIG_HELP = (
    "vLLM's speculative_config as JSON, e.g. '{\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'. method: ngram or suffix (both "
    "run ngramspec's n-gram drafter); num_speculative_tokens K: at most K draft tokens (tree "
    "nodes) verified per step (draft_token_num = K + 1, the tree's root included); prompt_lookup_max: the longest suffix "
    "looked up in the request's own text (max_context_match); prompt_lookup_min: checked, not "
    "used (every match length is tried and weighed by its measured acceptance). Other keys and "
    "methods (eagle, draft_model, ...) are errors.")


def parse_speculative_config(config: Mapping[str, Any] | str) -> dict[str, Any]:
    """A vLLM speculative_config (a mapping or its JSON text) as a dict; ValueError for text that
    is not a JSON object, TypeError for anything else that is not a mapping."""
    if not isinstance(config, str):
        if not isinstance(config, Mapping):
            raise TypeError(f"speculative_config must be a dict, not {type(config).__name__}")
        return dict(config)
    try:
        parsed = json.loads(config)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config is not valid JSON ({e})") from None
    if not isinstance(parsed, dict):  # the text is what is wrong, as for invalid JSON
        raise ValueError(  # noqa: TRY004
            f"speculative_config must be a JSON object, not {config!r}")
    return parsed


def speculative_options(config: Mapping[str, Any] | str) -> dict[str, Any]:
    """What a vLLM speculative_config means here: {"speculative": "ngram", <DrafterConfig field>:
    value, ...}. ValueError names an unsupported key, method or value."""
    config = parse_speculative_config(config)
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))}; ngramspec "
            f"maps only {', '.join(SPECULATIVE_CONFIG_KEYS)} (other drafter settings are options "
            "of their own, see DrafterConfig)")
    method = config.get("method")
    if method not in NGRAM_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported; ngramspec is model-free "
            f"and runs its n-gram drafter for method {' or '.join(map(repr, NGRAM_METHODS))}")
    out: dict[str, Any] = {"speculative": "ngram"}
    k = _positive_int(config, "num_speculative_tokens")
    if k is not None:
        out["draft_token_num"] = k + 1  # our tree size counts its root; K drafts are verified
    lo = _positive_int(config, "prompt_lookup_min")
    hi = _positive_int(config, "prompt_lookup_max")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi}")
    if hi is not None:
        out["max_context_match"] = hi
    return out


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {key}={value!r} must be a positive integer")
    return value


def merge_speculative_config(options: dict[str, Any],
                             config: Mapping[str, Any] | str) -> dict[str, Any]:
    """`options` (LLM keywords, or the options given on the command line) plus what a vLLM
    speculative_config means; ValueError where both set one thing differently. A `drafter`
    object takes the mapped fields; a field of it that is not its preset's default counts as
    set."""
    mapped = speculative_options(config)
    merged = dict(options)
    if "speculative" in options and options["speculative"] != "ngram":
        raise ValueError(f"speculative={options['speculative']!r} conflicts with "
                         "speculative_config, which turns n-gram speculation on")
    merged["speculative"] = mapped.pop("speculative")
    drafter = options.get("drafter")
    current = _set_fields(drafter) if isinstance(drafter, DrafterConfig) else options
    for name, value in mapped.items():
        if name in current and current[name] != value:
            raise ValueError(f"speculative_config's {_vllm_key(name)} means {name}={value}, "
                             f"but {name}={current[name]!r} is also given")
    if isinstance(drafter, DrafterConfig):
        merged["drafter"] = replace(drafter, **mapped)
    else:
        merged.update(mapped)
    return merged


def _set_fields(drafter: DrafterConfig) -> dict[str, Any]:
    """The fields of `drafter` that differ from its preset's defaults."""
    base = DrafterConfig.sglang() if drafter.preset == "sglang" else DrafterConfig()
    return {f.name: getattr(drafter, f.name) for f in fields(DrafterConfig)
            if getattr(drafter, f.name) != getattr(base, f.name)}


def _vllm_key(field_name: str) -> str:
    return next(k for k, v in _DRAFTER_FIELD.items() if v == field_name)


def load_chat_template(template: str | Path | None) -> str | None:
    """A chat template given as a file path or as the Jinja text itself (vLLM's rule: text with
    `{`, `}` or a newline is a template, anything else must be a readable file)."""
    if template is None:
        return None
    text = str(template)
    if isinstance(template, str) and any(c in text for c in "{}\n"):
        return text
    try:
        return Path(text).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"chat template {text!r} looks like a file path but cannot be read "
                         f"({e.strerror or e}); pass a template file or the Jinja text") from None


def seed_everything(seed: int) -> None:
    """vLLM's `seed`: requests without a seed of their own draw from the global generators."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
