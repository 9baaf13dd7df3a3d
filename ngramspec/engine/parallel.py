"""Tensor parallelism on torch.distributed (Megatron's layout); rank 0 drives, the others follow.

Each of N ranks holds 1/N of every decoder layer: q/k/v split by heads and gate/up by
intermediate channels (output rows), o_proj and down_proj split by the same input columns, so
each rank's partial sums meet in one all-reduce per sublayer (two a layer). Embeddings, norms and
the LM head are replicated, so every rank ends a forward with the whole hidden state, and the
K/V cache of a rank holds its own heads at the slots rank 0 allocated.

Only rank 0 runs the engine: it schedules, drafts, samples and owns every KV slot. For each
forward it broadcasts the step's `ForwardItem`s (query tokens, positions, slots and each draft
tree's mask: the flattened trees) and every rank builds the same tensors from them. So the other
ranks never draft, and no rank can disagree about a tree: a drafter state that drifted between
ranks would otherwise make the collective calls mismatch and hang.

Backends: NCCL on CUDA (rank r on cuda:r), gloo on the CPU. Dense weights only: GGUF blocks are
not split (quantization "auto" resolves to dense weights when N > 1).
"""

from __future__ import annotations

import atexit
import dataclasses
import socket
from typing import Any

import torch
import torch.distributed as dist

from ngramspec.config import EngineConfig
from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.models.config import ModelConfig
from ngramspec.models.loader import load_model_config, load_state_dict, resolve_model_dir


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the first dimension that N ranks cannot split evenly."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's "
                             f"{name}={value}; choose a divisor of it")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's slice: its heads and intermediate channels."""
    check_divisible(cfg, world)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                               num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def shard_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, world: int
                     ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of HF-named weights (q/k/v and gate/up not yet fused)."""
    if world == 1:
        return state
    check_divisible(cfg, world)
    d = cfg.head_dim
    q_rows = cfg.num_heads // world * d
    kv_rows = cfg.num_kv_heads // world * d
    inter = cfg.intermediate_size // world
    # name suffix -> (dim split, slice length)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
            "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": q_rows, "down_proj": inter}
    out = {}
    for name, w in state.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if module in rows:  # weight [out, in] and bias [out]: split the output rows
            n = rows[module]
            out[name] = w.narrow(0, rank * n, n).contiguous()
        elif module in cols and parts[-1] == "weight":  # [out, in]: split the input columns
            n = cols[module]
            out[name] = w.narrow(1, rank * n, n).contiguous()
        else:
            out[name] = w
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = config.torch_device
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def _build_runner(config: EngineConfig, rank: int, world: int, num_slots: int,
                  max_model_len: int) -> ModelRunner:
    model_dir = resolve_model_dir(config.model)
    cfg = load_model_config(model_dir)
    state = shard_state_dict(load_state_dict(model_dir), cfg, rank, world)
    return ModelRunner(shard_config(cfg, world), state, num_slots, max_model_len,
                       config.torch_dtype, _rank_device(config, rank), None,
                       config.torch_kv_dtype, all_reduce=_all_reduce if world > 1 else None)


def _all_reduce(x: torch.Tensor) -> None:
    dist.all_reduce(x)


def _worker(rank: int, world: int, init_method: str, config: EngineConfig, num_slots: int,
            max_model_len: int) -> None:
    """A follower rank: build its slice, then run whatever rank 0 broadcasts until "stop"."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = _rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank,
                            world_size=world)
    try:
        runner = _build_runner(config, rank, world, num_slots, max_model_len)
        dist.barrier()
        while True:
            cmd, payload = _receive()
            if cmd == "run":
                runner.run(payload)
            elif cmd == "load":
                full_cfg, state = payload
                runner.load_weights(shard_state_dict(state, full_cfg, rank, world))
            elif cmd == "stop":
                return
    finally:
        dist.destroy_process_group()


def _receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _send(cmd: str, payload: Any = None) -> None:
    dist.broadcast_object_list([(cmd, payload)], src=0)


class TensorParallelRunner:
    """ModelRunner's interface for the engine, over N processes: this one is rank 0."""

    def __init__(self, config: EngineConfig, num_slots: int, max_model_len: int) -> None:
        world = config.tensor_parallel_size
        device = _rank_device(config, 0)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs from {device}, "
                             f"this machine has {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already running in this "
                               "process; one tensor-parallel engine per process")
        self.full_cfg = load_model_config(resolve_model_dir(config.model))
        check_divisible(self.full_cfg, world)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers = [ctx.Process(target=_worker, daemon=True,
                                    args=(rank, world, init_method, config, num_slots,
                                          max_model_len))
                        for rank in range(1, world)]
        for w in self.workers:
            w.start()
        if device.type == "cuda":  # NCCL's object broadcasts use the current device
            torch.cuda.set_device(device)
        dist.init_process_group(_backend(device), init_method=init_method, rank=0,
                                world_size=world)
        self.world = world
        self.local = _build_runner(config, 0, world, num_slots, max_model_len)
        dist.barrier()  # every rank built its slice
        self.device = self.local.device
        self._closed = False
        atexit.register(self.close)

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> torch.Tensor:
        _send("run", items)
        return self.local.run(items)

    def load_weights(self, state: dict[str, torch.Tensor], gguf_weights: dict | None = None
                     ) -> None:
        """New weights on every rank: rank 0 checks its slice first (ValueError, nothing
        changed), then the whole state dict goes to the others through the process group."""
        if gguf_weights:
            raise ValueError("tensor parallelism runs dense weights; GGUF blocks are not split")
        self.local.load_weights(shard_state_dict(state, self.full_cfg, 0, self.world))
        _send("load", (self.full_cfg, state))

    def close(self) -> None:
        """Stop the follower ranks and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            _send("stop")
        finally:
            for w in self.workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            dist.destroy_process_group()
