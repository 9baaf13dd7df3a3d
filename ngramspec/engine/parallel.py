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
import logging
import signal
import socket
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ngramspec.config import EngineConfig
from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.models.config import ModelConfig
from ngramspec.models.loader import load_model_config, load_state_dict, resolve_model_dir

log = logging.getLogger(__name__)
# How long ranks wait for each other to start and build their slices (torch's default is 30
# min on gloo): a follower that dies while loading fails the start within this.
START_TIMEOUT = timedelta(minutes=5)


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
                       config.torch_kv_dtype, all_reduce=_all_reduce if world > 1 else None,
                       attention_backend=config.attention_backend)


def _all_reduce(x: torch.Tensor) -> None:
    dist.all_reduce(x)


def _worker(rank: int, world: int, init_method: str, config: EngineConfig, num_slots: int,
            max_model_len: int) -> None:
    """A follower rank: build its slice, then run whatever rank 0 broadcasts until "stop".

    Any error ends the process (logged): a rank that missed part of a forward can never rejoin
    the collectives, and rank 0 checks that its followers live before every command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = _rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank,
                            world_size=world, timeout=START_TIMEOUT)
    try:
        runner = _build_runner(config, rank, world, num_slots, max_model_len)
        dist.barrier()
        while True:
            cmd, payload = _receive(device)
            if cmd == "run":
                runner.run(payload)
            elif cmd == "load":
                full_cfg, state = payload
                runner.load_weights(shard_state_dict(state, full_cfg, rank, world))
            elif cmd == "stop":
                return
    except Exception:
        log.exception("tensor-parallel rank %d failed; it leaves the group", rank)
        raise
    finally:
        dist.destroy_process_group()


def _receive(device: torch.device) -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def _send(device: torch.device, cmd: str, payload: Any = None) -> None:
    # The device is explicit: NCCL would otherwise use the calling thread's current device,
    # and the server runs the engine on its own thread.
    dist.broadcast_object_list([(cmd, payload)], src=0, device=device)


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
                                world_size=world, timeout=START_TIMEOUT)
        self.world = world
        self.local = _build_runner(config, 0, world, num_slots, max_model_len)
        dist.barrier()  # every rank built its slice
        self.device = self.local.device
        # rank 0's run waits for the other ranks' broadcasts: drafting cannot hide behind it
        self.asynchronous = False
        self._closed = False
        self._broken: str | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _command(self, cmd: str, payload: Any = None) -> None:
        """Broadcast a command, once every follower is known to be alive."""
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken ({self._broken}); "
                               "restart the engine")
        dead = [r for r, w in enumerate(self.workers, 1) if not w.is_alive()]
        if dead:
            self._broken = f"rank(s) {dead} exited"
            raise RuntimeError(f"tensor-parallel rank(s) {dead} exited; restart the engine")
        _send(self.device, cmd, payload)

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> torch.Tensor:
        self._command("run", items)
        try:
            return self.local.run(items)
        except Exception as e:
            # The followers may be inside this forward's collectives: the ranks are out of
            # step, so every later step must fail rather than hang.
            self._broken = f"a forward failed on rank 0: {e}"
            raise

    def take_device_seconds(self) -> float:
        """Rank 0's forward time (ModelRunner.take_device_seconds)."""
        return self.local.take_device_seconds()

    def load_weights(self, state: dict[str, torch.Tensor], gguf_weights: dict | None = None
                     ) -> None:
        """New weights on every rank: rank 0 checks its slice first (ValueError, nothing
        changed), then the whole state dict goes to the others through the process group."""
        if gguf_weights:
            raise ValueError("tensor parallelism runs dense weights; GGUF blocks are not split")
        self.local.load_weights(shard_state_dict(state, self.full_cfg, 0, self.world))
        self._command("load", (self.full_cfg, state))

    def close(self) -> None:
        """Stop the follower ranks and leave the process group (idempotent)."""
        with self._lock:  # atexit and the engine's owner may both call it
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)  # else atexit would keep the model alive
        try:
            if self._broken is None and all(w.is_alive() for w in self.workers):
                _send(self.device, "stop")
        finally:
            for w in self.workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            dist.destroy_process_group()
