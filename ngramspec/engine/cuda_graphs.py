"""Decode and tree-verify steps replayed as CUDA graphs (nano-vllm does this for decode).

A small model's step is a few hundred short kernels; launched one by one from Python, the launches
cost more than the kernels. A CUDA graph replays all of them with one call. Its inputs must live at
fixed addresses, so every step's token ids, positions, slots, logit rows and paged-attention
metadata (layers/attention.py's PagedMetadata) are copied into static buffers, padded to the step's
bucket:
- tokens, to the bucket's T_b: a pad token reads token 0 at position 0, writes its K/V to the pad
  slot (a cache row past the allocator's slots, which no sequence owns) and belongs to no sequence,
  so attention computes nothing for it and its rows are never read;
- sequences, to B_b = min(T_b, max_seqs): a pad sequence has no tokens;
- logit rows, to T_b (pad rows read row 0);
- the Triton kernel's grid: cdiv(the longest item, 16) query blocks.
One graph per (T_b, query blocks): those of one query block (every decode, every tree of up to 16
nodes) are captured at start, the others the first time a step needs one. Steps that do not fit
(a long prefill chunk, more prefix slots than the buffers hold) run eagerly.

All of a step's host lists go into one pinned int64 buffer with the device buffers' layout, then
over in two copies: no per-tensor `torch.tensor(..., device=)` round trips.

Without CUDA (`capture=False`), the padded static inputs run the model directly: the tests check the
padding against the unpadded path on the CPU kernel, which reads the same metadata.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from ngramspec.engine.step_inputs import FlatStep
from ngramspec.layers.attention import AttentionMetadata, KVCache, PagedMetadata

# Token buckets: dense where decode batches and their trees land, sparser above.
TOKEN_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
QUERY_BLOCK = 16  # the Triton kernel's query tokens per program (layers/triton_attention.py)


@dataclass(frozen=True, slots=True)
class GraphLimits:
    """What the static buffers hold; a step beyond any of these runs eagerly."""

    max_tokens: int  # the largest token bucket
    max_seqs: int
    max_query: int  # the longest item (tree or chunk)
    max_prefix: int  # cached prefix slots of all sequences together
    max_local: int  # tree tokens' visible-slot entries together

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_seqs", "max_query", "max_prefix", "max_local"):
            if getattr(self, name) < 1:
                raise ValueError(f"GraphLimits.{name} must be >= 1")

    @classmethod
    def for_engine(cls, max_batched_tokens: int, max_seqs: int, max_model_len: int
                   ) -> GraphLimits:
        tokens = min(max_batched_tokens, TOKEN_BUCKETS[-1])
        query = min(64, tokens)
        # one full-length prefix per sequence; a tree token sees at most `query` query slots
        return cls(tokens, max_seqs, query, max_seqs * max_model_len, tokens * query)


class StepGraphs:
    """Static inputs, bucketing and one CUDA graph per bucket for a ModelRunner's model."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, pad_slot: int, limits: GraphLimits,
                 device: torch.device, capture: bool) -> None:
        self.model, self.cache, self.pad_slot, self.limits = model, cache, pad_slot, limits
        self.capture = capture
        t, b = limits.max_tokens, limits.max_seqs
        self.buckets = [n for n in TOKEN_BUCKETS if n < t] + [t]
        # field -> (offset, length) in the flat buffers; prefix last (the longest, used in part)
        sizes = {"ids": t, "positions": t, "slots": t, "rows": t, "seq_offsets": b + 1,
                 "prefix_offsets": b + 1, "causal": b, "local_offsets": t + 1,
                 "local": limits.max_local, "prefix": limits.max_prefix}
        self.layout, at = {}, 0
        for name, n in sizes.items():
            self.layout[name] = (at, n)
            at += n
        self.device_buf = torch.zeros(at, dtype=torch.long, device=device)  # [fields]
        self.host_buf = torch.zeros(at, dtype=torch.long, pin_memory=capture)
        self.host = self.host_buf.numpy()
        self.logits: torch.Tensor | None = None  # [max_tokens, vocab] float32, on first capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.copied = torch.cuda.Event() if capture else None  # the last host -> device copy

    # ------------------------------------------------------------------ choosing a bucket

    def bucket(self, flat: FlatStep) -> tuple[int, int] | None:
        """(T_b, query blocks) for this step, or None when it does not fit the buffers."""
        lim = self.limits
        num_tokens, num_seqs = len(flat.token_ids), len(flat.seq_offsets) - 1
        if (num_tokens == 0 or num_tokens > lim.max_tokens or flat.max_query_len > lim.max_query
                or flat.num_prefix > lim.max_prefix or len(flat.local) > lim.max_local):
            return None
        t_b = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        if num_seqs > min(t_b, lim.max_seqs):
            return None
        return t_b, -(-flat.max_query_len // QUERY_BLOCK)

    @torch.inference_mode()
    def capture_all(self, query_blocks: int = 1) -> None:
        """Capture every token bucket of `query_blocks` now (decodes and trees up to 16 nodes), so
        that serving never stalls on a capture; other buckets are captured on first use."""
        for t_b in reversed(self.buckets):  # largest first: later ones reuse its pool memory
            if (t_b, query_blocks) not in self.graphs:
                self.graphs[(t_b, query_blocks)] = self._capture(t_b, query_blocks)

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def run(self, flat: FlatStep,
            timed: Callable[[], AbstractContextManager] = contextlib.nullcontext
            ) -> torch.Tensor | None:
        """Logits of the step's requested rows ([R, vocab] float32), or None: run it eagerly.
        `timed()` wraps the device work (the replay), not the host's preparation."""
        key = self.bucket(flat)
        if key is None:
            return None
        if self.copied is not None:
            self.copied.synchronize()  # the host buffer may still be read by the last copy
        if self.capture and key not in self.graphs:
            self.graphs[key] = self._capture(*key)  # on idle inputs, before the step's own
        self._fill(flat, key[0])
        self._upload(len(flat.local), flat.num_prefix)
        num_rows = len(flat.logit_rows)
        with timed():
            if not self.capture:
                return self._forward(*key)[:num_rows]
            self.graphs[key].replay()
        assert self.logits is not None
        # a copy: the static rows are overwritten by the next replay
        return self.logits[:num_rows].clone()

    def _fill(self, flat: FlatStep, t_b: int) -> None:
        """Write the step's lists into the host buffer, padded to bucket t_b."""
        b_b = min(t_b, self.limits.max_seqs)
        num_seqs = len(flat.seq_offsets) - 1
        pad = {"ids": (flat.token_ids, 0, t_b), "positions": (flat.positions, 0, t_b),
               "slots": (flat.slots, self.pad_slot, t_b), "rows": (flat.logit_rows, 0, t_b),
               "seq_offsets": (flat.seq_offsets, flat.seq_offsets[-1], b_b + 1),
               "prefix_offsets": (flat.prefix_offsets, flat.num_prefix, b_b + 1),
               "causal": (flat.causal, 1, b_b),
               "local_offsets": (flat.local_offsets, len(flat.local), t_b + 1),
               "local": (flat.local, 0, len(flat.local)),
               "prefix": (flat.prefix(), 0, flat.num_prefix)}
        for name, (values, fill, length) in pad.items():
            at = self.layout[name][0]
            n = len(values)
            self.host[at : at + n] = values
            self.host[at + n : at + length] = fill
        assert num_seqs <= b_b

    def _upload(self, num_local: int, num_prefix: int) -> None:
        """Copy the used part of the host buffer: everything up to the local list's end, then the
        prefix list."""
        end = self.layout["local"][0] + num_local
        self.device_buf[:end].copy_(self.host_buf[:end], non_blocking=self.capture)
        at = self.layout["prefix"][0]
        if num_prefix:
            self.device_buf[at : at + num_prefix].copy_(self.host_buf[at : at + num_prefix],
                                                        non_blocking=self.capture)
        if self.copied is not None:
            self.copied.record()

    def _view(self, name: str, length: int | None = None) -> torch.Tensor:
        at, n = self.layout[name]
        return self.device_buf[at : at + (n if length is None else length)]

    def _forward(self, t_b: int, query_blocks: int) -> torch.Tensor:
        """The model on the static inputs of bucket (t_b, query_blocks): [t_b, vocab] float32."""
        b_b = min(t_b, self.limits.max_seqs)
        paged = PagedMetadata(self._view("seq_offsets", b_b + 1), self._view("prefix"),
                              self._view("prefix_offsets", b_b + 1), self._view("local"),
                              self._view("local_offsets", t_b + 1), self._view("causal", b_b),
                              query_blocks * QUERY_BLOCK)
        meta = AttentionMetadata(self._view("slots", t_b), [], paged)
        return self.model(self._view("ids", t_b), self._view("positions", t_b), self.cache, meta,
                          self._view("rows", t_b))

    def _capture(self, t_b: int, query_blocks: int) -> torch.cuda.CUDAGraph:
        """Record bucket (t_b, query_blocks) on idle inputs: no sequence, every token on the pad
        slot, so the warm-up run (which compiles the kernels) and the capture change nothing."""
        idle = FlatStep([0] * t_b, [0] * t_b, np.full(t_b, self.pad_slot, np.int64),
                        list(range(t_b)), [0], [], [0], np.zeros(0, np.int64),
                        np.zeros(t_b + 1, np.int64), [], 1)
        self._fill(idle, t_b)
        self._upload(0, 0)
        warm = self._forward(t_b, query_blocks)
        if self.logits is None:
            self.logits = torch.empty(self.limits.max_tokens, warm.shape[1], dtype=warm.dtype,
                                      device=warm.device)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[:t_b] = self._forward(t_b, query_blocks)
        return graph
