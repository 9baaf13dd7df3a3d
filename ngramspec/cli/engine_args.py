"""Options shared by the commands that run the model: engine (with the drafter's and vLLM's
`--speculative-config`) and sampling. A leaf module: sub-commands import it, not the reverse."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ngramspec.cli.drafter_args import add_drafter_args, drafter_config, drafter_fields_from_args
from ngramspec.vllm_compat import (
    SPECULATIVE_CONFIG_HELP,
    merge_speculative_config,
    parse_speculative_config,
)


def add_engine_args(parser: argparse.ArgumentParser, model_help: str | None = None) -> None:
    """Engine options shared by every command that runs the model (plus all drafter options)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help=model_help or "GGUF file, HF model directory, or HF model id (org/name) "
                                      "already in the local HF cache (default: SmolLM2-135M)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16 (also vLLM's float, half)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf"],
                   help="gguf: run a GGUF model's block-quantised matrices (Q4_0 ... Q8_0, "
                        "Q4_K/Q5_K/Q6_K) with the native CPU kernels; none: dequantise to --dtype; "
                        "auto (default): gguf for a GGUF model on the CPU unless --dtype is given")
    g.add_argument("--gguf-activations", default="auto", choices=["auto", "float32", "int8"],
                   help="what the GGUF kernels multiply by: int8 (activations quantised per 32 "
                        "values, as llama.cpp; auto) or float32")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="K/V storage (auto: the activations' dtype; bfloat16 with --quantization gguf)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "triton"],
                   help="auto: the C++ kernel on the CPU, Triton on CUDA (SDPA where missing)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, launch every kernel from Python instead of replaying CUDA graphs")
    g.add_argument("--max-model-len", type=int, default=4096,
                   help="longest prompt + output in tokens (default: 4096)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="K/V memory budget in GiB (default: 1 on the CPU; on CUDA room for "
                        "--max-num-seqs full-length sequences, at most 30%% of the GPU)")
    g.add_argument("--no-prefix-cache", "--no-enable-prefix-caching",
                   dest="enable_prefix_caching", action="store_false",
                   help="prefill every prompt in full (default: reuse cached prefixes' K/V)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   help="reuse cached prefixes' K/V (the default; vLLM's spelling)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N processes (NCCL on CUDA, gloo on the CPU)")
    g.add_argument("--speculative", choices=["ngram", "none"], default=None,
                   help="model-free n-gram speculative decoding (default: none)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON", help=SPECULATIVE_CONFIG_HELP.replace("%", "%%"))
    g.add_argument("--verify-cost", type=verify_cost_arg, default=None, metavar="flat|C1,C2,...",
                   help="forward cost vs query tokens (1, 2, 4, 8, 12, 16, ...) relative to one "
                        "token; 'flat' always drafts full trees; default: measured at start")
    g.add_argument("--draft-sizing", choices=["auto", "cost", "full"], default="auto",
                   help="verify the prefix of each tree that pays for its cost, or the full tree "
                        "(auto: full for the sglang preset)")
    g.add_argument("--speculative-algorithm", dest="speculative", type=str.lower,
                   choices=["ngram", "none"], help=argparse.SUPPRESS)  # SGLang spelling
    add_drafter_args(parser)


def _speculative_config(text: str) -> dict[str, Any]:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def verify_cost_arg(text: str) -> list[float]:
    from ngramspec.policy.cost import DEFAULT_POINTS

    if text == "flat":
        return [1.0] * len(DEFAULT_POINTS)
    return positive_floats(text, "--verify-cost", "'flat' or numbers")


def positive_floats(text: str, option: str, hint: str) -> list[float]:
    """`option`'s comma-separated positive numbers, or an error naming it (`hint`: what to use)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{option} {text!r}: use {hint}") from None
    if not values or any(not 0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{option} values must be positive")
    return values


def speculative_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{"speculative": "ngram" | None, <DrafterConfig field>: value} from --speculative, the
    drafter options and --speculative-config; ValueError where they contradict each other."""
    options: dict[str, Any] = drafter_fields_from_args(args)
    if args.speculative is not None:
        options["speculative"] = None if args.speculative == "none" else args.speculative
    config = getattr(args, "speculative_config", None)
    if config is not None:
        try:
            options = merge_speculative_config(options, config)
        except ValueError as e:  # in the spelling the user typed
            raise ValueError(str(e).replace("speculative_config", "--speculative-config")) from None
    options.setdefault("speculative", None)
    return options


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keywords (`drafter` a DrafterConfig); ValueError names a bad option."""
    drafter_options = speculative_from_args(args)
    speculative = drafter_options.pop("speculative")
    kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * (1 << 30))
    return {"model": args.model, "device": args.device, "dtype": args.dtype,
            "quantization": args.quantization, "gguf_activations": args.gguf_activations,
            "kv_cache_dtype": args.kv_cache_dtype, "attention_backend": args.attention_backend,
            "enforce_eager": args.enforce_eager, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_bytes": kv_bytes,
            "num_threads": args.threads, "tensor_parallel_size": args.tensor_parallel_size,
            "enable_prefix_caching": args.enable_prefix_caching, "speculative": speculative,
            "drafter": drafter_config(drafter_options), "verify_cost": args.verify_cost,
            "draft_sizing": args.draft_sizing}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def sampling_params_from_args(args: argparse.Namespace):
    from ngramspec.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
