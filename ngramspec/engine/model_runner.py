"""ModelRunner: turns a step's query tokens into tensors, runs the model, returns logits."""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ngramspec.drafting.kernels import native
from ngramspec.engine.cuda_graphs import GraphLimits, StepGraphs
from ngramspec.engine.step_inputs import FlatStep, ForwardItem, flatten
from ngramspec.kernels import cpu_kernels, kernels_available
from ngramspec.layers.attention import (
    AttentionGroup,
    AttentionMetadata,
    KVCache,
    PagedAttention,
    PagedMetadata,
)
from ngramspec.layers.linear import pack_linears
from ngramspec.models.config import ModelConfig
from ngramspec.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, state: dict[str, torch.Tensor], num_slots: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device,
                 gguf_weights: dict | None = None, kv_dtype: torch.dtype | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None,
                 attention_backend: str = "auto", graphs: GraphLimits | None = None,
                 gguf_int8: bool = False) -> None:
        """`gguf_weights` ({HF name: GGUFWeight}): matrices to run from their GGUF blocks
        (`gguf_int8`: with int8 activations, EngineConfig.gguf_activations);
        `kv_dtype`: the K/V cache's dtype (default: `dtype`); `all_reduce`: sums a tensor over
        the tensor-parallel ranks in place (engine/parallel.py; `model_cfg` is then this rank's
        slice); `attention_backend`: EngineConfig.attention_backend; `graphs`: replay steps that
        fit these limits as CUDA graphs (engine/cuda_graphs.py; paged attention only, SDPA runs
        eagerly; on the CPU the padded static inputs run without capture, for the tests)."""
        self.device, self.dtype = device, dtype
        self.all_reduce = all_reduce
        self.gguf_int8 = gguf_int8
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.attention = _attention_backend(attention_backend, device, dtype)
        # The CPU and Triton kernels read K/V in place from PagedMetadata; SDPA needs groups.
        self.paged = self.attention != "sdpa"
        if self.paged:
            native()  # the tree-list kernel, built (once per machine) outside any timed step
        self.model = self._build(state, gguf_weights)
        kv_dtype = kv_dtype or dtype
        if kv_dtype != dtype and not self.paged:
            raise ValueError(f"a {kv_dtype} KV cache under {dtype} activations needs the CPU "
                             "or Triton attention kernel; use the same dtype on this device")
        # one row past the allocator's slots: where padded graph steps write their pad tokens
        self.pad_slot = num_slots
        self.cache = KVCache(model_cfg.num_layers, num_slots + 1, model_cfg.num_kv_heads,
                             model_cfg.head_dim, kv_dtype, device)
        self._causal: dict[int, torch.Tensor] = {}
        # SDPA builds per-step groups and masks, which a graph cannot hold: it runs eagerly
        self.graph_limits = graphs if self.paged else None
        self.graphs = self._graphs()
        self._device_seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA forwards

    @property
    def asynchronous(self) -> bool:
        """Whether `run` returns before the device has finished (CUDA launches are queued)."""
        return self.device.type == "cuda"

    def _graphs(self) -> StepGraphs | None:
        if self.graph_limits is None:
            return None
        graphs = StepGraphs(self.model, self.cache, self.pad_slot, self.graph_limits, self.device,
                            capture=self.device.type == "cuda")
        if graphs.capture:
            graphs.capture_all()
        return graphs

    def _build(self, state: dict[str, torch.Tensor], gguf_weights: dict | None
               ) -> LlamaForCausalLM:
        with torch.device(self.device), _without_random_init():
            model = LlamaForCausalLM(self.model_cfg, max_positions=self.max_model_len + 64)
        model.load_hf_state_dict(state)  # every matrix, or a ValueError naming the missing
        model = model.to(dtype=self.dtype).eval()
        model.rope.to(torch.float32)  # keep cos/sin exact; they are cast per use
        if gguf_weights:
            model.use_gguf_weights(gguf_weights, int8=self.gguf_int8)
        if self.attention == "cpu":
            model.attention = PagedAttention()
            model.use_cpu_kernels(cpu_kernels())
        elif self.attention == "triton":
            from ngramspec.layers.triton_attention import TritonPagedAttention

            model.attention = TritonPagedAttention()
        if self.all_reduce is not None:
            model.use_all_reduce(self.all_reduce)
        pack_linears(model)
        model.use_decoder_stack()
        return model

    def load_weights(self, state: dict[str, torch.Tensor], gguf_weights: dict | None = None
                     ) -> None:
        """Replace every weight (same architecture and shapes; ValueError otherwise). The K/V
        cache stays allocated; what it holds was computed by the old weights (the caller
        drops it)."""
        try:
            model = self._build(state, gguf_weights)
        except (KeyError, RuntimeError) as e:  # a missing matrix, or shapes that differ
            raise ValueError(f"the new weights do not fit this model: {e}") from e
        self.model = model
        self.graphs = None  # the old graphs replay the old weights; free them before capturing
        self.graphs = self._graphs()

    def close(self) -> None:
        """Nothing to release in one process (engine/parallel.py's runner stops its ranks)."""

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> torch.Tensor:
        """Logits for every requested row, item by item in order: [num_rows, vocab] float32."""
        flat = flatten(items, self.paged)
        if self.graphs is not None and (logits := self.graphs.run(flat, self._timed)) is not None:
            return logits
        input_ids, positions, meta, logits_index = self._prepare(items, flat)
        with self._timed():
            return self.model(input_ids, positions, self.cache, meta, logits_index)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Time the device work launched inside (CUDA events, resolved once complete; wall time on
        the CPU, where the work is done when the block ends). Host preparation stays outside."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self._device_seconds += time.perf_counter() - t0
            return
        self._resolve_events()  # keeps the list short where nobody takes the total (TP followers)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))

    def _resolve_events(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self._device_seconds += start.elapsed_time(end) / 1000

    def take_device_seconds(self) -> float:
        """Seconds the device spent in forwards since the last call (host work and waits
        excluded). A CUDA forward still running is counted by a later call."""
        self._resolve_events()
        seconds, self._device_seconds = self._device_seconds, 0.0
        return seconds

    def _prepare(self, items: list[ForwardItem], flat: FlatStep):
        dev = self.device
        groups = [] if self.paged else self._groups(items)
        meta = AttentionMetadata(long_tensor(flat.slots, dev), groups,
                                 paged_metadata(flat, dev) if self.paged else None)
        return (long_tensor(flat.token_ids, dev), long_tensor(flat.positions, dev), meta,
                long_tensor(flat.logit_rows, dev))

    def _groups(self, items: list[ForwardItem]) -> list[AttentionGroup]:
        """SDPA groups: sequences padded together by query-length class."""
        # size class -> (its items, their offsets in the flat token order)
        by_size: dict[int, tuple[list[ForwardItem], list[int]]] = {}
        offset = 0
        for it in items:
            members, offsets = by_size.setdefault(
                bisect.bisect_left(SIZE_CLASS_LIMITS, len(it.token_ids)), ([], []))
            members.append(it)
            offsets.append(offset)
            offset += len(it.token_ids)
        return [self._group(members, offsets, whole=len(by_size) == 1)
                for _, (members, offsets) in sorted(by_size.items())]

    def _group(self, items: list[ForwardItem], offsets: list[int], whole: bool) -> AttentionGroup:
        """Pad these sequences' queries to their longest and their K/V to the longest prefix."""
        if len(items) == 1:
            group = self._range_group(items[0], offsets[0], whole)
            if group is not None:
                return group
        dev = self.device
        num_q = max(len(it.token_ids) for it in items)
        num_kv = max(len(it.prefix_slots) + len(it.slots) for it in items)
        kv_rows, q_rows, out_rows, token_rows = [], [], [], []
        for b, (it, offset) in enumerate(zip(items, offsets)):
            n = len(it.token_ids)
            kv = it.prefix_slots + it.slots
            kv_rows.append(kv + [0] * (num_kv - len(kv)))
            q_rows.append(list(range(offset, offset + n)) + [0] * (num_q - n))
            out_rows += range(b * num_q, b * num_q + n)
            token_rows += range(offset, offset + n)
        prefix_lens = torch.tensor([len(it.prefix_slots) for it in items], device=dev)
        cols = torch.arange(num_kv, device=dev)
        mask = (cols[None, :] < prefix_lens[:, None])[:, None, None, :].repeat(1, 1, num_q, 1)
        for b, it in enumerate(items):
            n, p = len(it.token_ids), len(it.prefix_slots)
            mask[b, 0, :n, p : p + n] = self._local_mask(it)
            mask[b, 0, n:, 0] = True  # padded query rows must see something (else NaN)
        return AttentionGroup(
            query_index=torch.tensor(q_rows, device=dev),
            kv_slots=torch.tensor(kv_rows, device=dev),
            kv_range=None,
            mask=mask,
            output_index=torch.tensor(out_rows, device=dev),
            token_index=None if whole else torch.tensor(token_rows, device=dev),
        )

    def _range_group(self, it: ForwardItem, offset: int, whole: bool) -> AttentionGroup | None:
        """One sequence whose slots are exactly one range [lo, hi): its K/V are read in place, in
        slot order (attention does not care about key order; RoPE already holds positions).
        None when the slots have holes."""
        kv = it.prefix_slots + it.slots
        lo, hi = min(kv), max(kv) + 1
        if hi - lo != len(kv):
            return None
        dev, n = self.device, len(it.token_ids)
        mask = None
        if n > 1:  # the prefix is open to every query; the query tokens see what their mask says
            mask = torch.ones(n, hi - lo, dtype=torch.bool, device=dev)  # [Q, L]
            cols = torch.tensor([s - lo for s in it.slots], device=dev)
            mask[:, cols] = self._local_mask(it)
            mask = mask[None, None]  # [1, 1, Q, L]
        rows = None if whole else torch.arange(offset, offset + n, device=dev)
        return AttentionGroup(query_index=None if rows is None else rows[None], kv_slots=None,
                              kv_range=(lo, hi), mask=mask, output_index=None, token_index=rows)

    def _local_mask(self, it: ForwardItem) -> torch.Tensor:
        if not it.causal:
            return torch.tensor(it.mask(), device=self.device)
        n = len(it.token_ids)
        if n not in self._causal:
            self._causal[n] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        return self._causal[n]


def long_tensor(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """[len] int64 on `device`. Through numpy: `torch.tensor` of a Python list is ~5x slower
    at the length of a large batch's tree lists (thousands of ints). The dtype is explicit: an
    empty list (a step of mid-prompt chunks needs no logits) must still index."""
    return torch.from_numpy(np.asarray(values, np.int64)).to(device)


def paged_metadata(flat: FlatStep, device: torch.device) -> PagedMetadata:
    """A flattened step's attention lists as tensors on `device`."""
    def t(values: list[int] | np.ndarray) -> torch.Tensor:
        return long_tensor(values, device)

    prefix = torch.from_numpy(flat.prefix()).to(device)
    return PagedMetadata(t(flat.seq_offsets), prefix, t(flat.prefix_offsets),
                         t(flat.local), t(flat.local_offsets), t(flat.causal), flat.max_query_len)


def _attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """"cpu" (the C++ kernel), "triton" or "sdpa" for EngineConfig.attention_backend."""
    if requested == "sdpa":
        return "sdpa"
    if requested == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' runs on CUDA (on the CPU only under "
                             "TRITON_INTERPRET=1, for tests)")
        return "triton"
    if device.type == "cpu":
        cpu_ok = dtype in (torch.float32, torch.bfloat16) and kernels_available()
        return "cpu" if cpu_ok else "sdpa"
    return "triton" if importlib.util.find_spec("triton") is not None else "sdpa"


# Query-length classes padded together (class = bisect_left(limits, n)): single-token decodes,
# draft trees and short chunks, and long prefill chunks. More classes pad less but cost an SDPA
# call per layer each.
SIZE_CLASS_LIMITS = (1, 16)


@contextlib.contextmanager
def _without_random_init() -> Iterator[None]:
    """Linear and embedding weights made without their random init: the checkpoint overwrites
    every one (load_hf_state_dict refuses a missing one), and the init was a large share of an
    engine's start on the CPU."""
    saved = torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = _no_init
    try:
        yield
    finally:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = saved


def _no_init(module: torch.nn.Module) -> None:
    return None
