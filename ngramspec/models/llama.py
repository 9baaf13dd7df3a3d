"""One decoder for the Llama family: Llama, SmolLM, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norm)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ngramspec.layers.attention import (
    AttentionMetadata,
    KVCache,
    PagedAttention,
    ReferenceAttention,
)
from ngramspec.layers.linear import Linear
from ngramspec.layers.norm import RMSNorm
from ngramspec.layers.rotary import RotaryEmbedding, RotaryTable, apply_rotary
from ngramspec.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul: fewer, larger kernels are what make small models fast.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    ops: ModuleType | None = None  # the fused CPU kernels (ngramspec.kernels), or None
    # Tensor parallelism: o_proj holds this rank's input columns, so its output is a partial
    # sum that this adds up over the ranks in place (engine/parallel.py). None: one rank.
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(
        self, x: torch.Tensor, rotary: RotaryTable,
        backend: ReferenceAttention | PagedAttention, cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]  # x: [T, hidden]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        fused_rope = self.ops is not None and self.q_norm is None
        if fused_rope:  # rotate q and k in place inside the fused row; no copies
            cos, sin = rotary
            self.ops.rope_(qkv, cos.view(t, -1), sin.view(t, -1),
                           self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not fused_rope:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(rotary, q, k)
        out = self.o_proj(backend(self.layer, q, k, v, cache, meta))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    ops: ModuleType | None = None
    all_reduce: Callable[[torch.Tensor], None] | None = None  # as Attention.all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            out = self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary, backend, cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the sublayer output, so each "add, then norm" is
        one op (vLLM's layout): returns (this layer's MLP output, the residual before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, backend, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)
        self.attention: ReferenceAttention | PagedAttention = ReferenceAttention()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata, logits_index: torch.Tensor,
    ) -> torch.Tensor:
        # input_ids, positions: [T]; logits_index: [N] rows that need logits -> [N, vocab]
        x = self.embed_tokens(input_ids)
        # the fused CPU rope reads float32 cos/sin and rounds them to the activations' dtype
        rotary = self.rope.table(positions, torch.float32 if self.cpu_ops else x.dtype)
        if self.stack is not None:
            x, residual = self.stack(x, rotary, cache, meta)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, rotary, self.attention, cache, meta)
        h, _ = self.norm(x[logits_index], residual[logits_index])
        return self.lm_head(h).float()

    # Every layer in one kernel call (`use_decoder_stack`), or None: the Python layers.
    stack: DecoderStack | None = None

    @property
    def cpu_ops(self) -> bool:
        return self.norm.ops is not None

    def use_decoder_stack(self) -> None:
        """Run the layers through the CPU kernels' `decoder_stack` where it makes exactly the
        calls the Python layers would (`use_cpu_kernels` done, GGUF linears without bias or AMX,
        no q/k norm, one rank); `stack` says whether it does. Call once weights, kernels and
        all-reduce are in place."""
        self.stack = DecoderStack.of(self)

    def use_cpu_kernels(self, ops: ModuleType) -> None:
        """Run norms, rotary and SiLU-mul through the fused CPU kernels (`ngramspec.kernels`)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def use_all_reduce(self, all_reduce: Callable[[torch.Tensor], None]) -> None:
        """Tensor parallelism: sum each sublayer's partial output over the ranks."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.all_reduce = all_reduce

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up into our packed projections."""
        ours: dict[str, torch.Tensor] = {}
        for name, w in state.items():
            name = name.removeprefix("model.")
            if ".rotary_emb." in name:
                continue
            ours[name] = w
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [ours.pop(f"{p}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
                if all(t is not None for t in parts):
                    ours[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, 0)
            gate, up = ours.pop(f"{p}mlp.gate_proj.weight"), ours.pop(f"{p}mlp.up_proj.weight")
            ours[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up], 0)
        if "lm_head.weight" not in ours:
            ours["lm_head.weight"] = ours["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")

    def use_gguf_weights(self, weights: dict, int8: bool = False) -> None:
        """Swap linears (and the embedding) for GGUF block kernels where `weights` ({HF name:
        GGUFWeight}) has them, with int8 or float32 activations (`int8`); q/k/v and gate/up run
        as one kernel when their types agree, else one per matrix. Call after
        `load_hf_state_dict` (biases and norms come from there)."""
        from ngramspec.layers.gguf_linear import GGUFEmbedding, GGUFLinear, gguf_linear

        def get(name: str):
            return weights.get(f"model.{name}.weight")

        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            groups = [("qkv_proj", attn, [get(f"{p}self_attn.{x}_proj") for x in "qkv"]),
                      ("o_proj", attn, [get(f"{p}self_attn.o_proj")]),
                      ("gate_up_proj", mlp, [get(f"{p}mlp.gate_proj"), get(f"{p}mlp.up_proj")]),
                      ("down_proj", mlp, [get(f"{p}mlp.down_proj")])]
            for attr, owner, parts in groups:
                if all(w is not None for w in parts):  # else the dense weights stay
                    setattr(owner, attr, gguf_linear(parts, getattr(owner, attr).bias, int8))
        embed = get("embed_tokens")
        head = weights.get("lm_head.weight", embed)  # tied when the file has no output.weight
        if embed is not None:
            self.embed_tokens = GGUFEmbedding(embed)
        if head is not None:
            self.lm_head = GGUFLinear(head, int8=int8)


class DecoderStack:
    """The arguments of `decoder_stack` (kernels/decoder_stack.cpp) for one model, gathered once:
    each layer's norm weights and packed GGUF matrices (qkv, o, gate_up, down), each matrix one
    GGUFLinear or the pieces of a GGUFStack."""

    def __init__(self, model: LlamaForCausalLM, ops: ModuleType) -> None:
        cfg = model.cfg
        self._ops = ops
        self.norms = [w for layer in model.layers for w in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        matrices = [m for layer in model.layers for m in _matrices(layer)]
        self.parts = [len(_pieces(m)) for m in matrices]
        linears = [piece for m in matrices for piece in _pieces(m)]
        self.blocks = [m.blocks for m in linears]
        self.qtypes = [m.qtype for m in linears]
        self.outputs = [m.out_features for m in linears]
        self.int8 = linears[0].int8  # one mode for the whole model (`of` checks)
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> DecoderStack | None:
        """The stack of `model`, or None where it would not make the Python layers' calls."""
        ops = model.norm.ops
        if ops is None or not isinstance(model.attention, PagedAttention):
            return None
        if not all(_layer_fits(layer, model.cfg.rms_norm_eps) for layer in model.layers):
            return None
        modes = {m.int8 for layer in model.layers for matrix in _matrices(layer)
                 for m in _pieces(matrix)}
        return cls(model, ops) if len(modes) == 1 else None

    def __call__(self, x: torch.Tensor, rotary: RotaryTable, cache: KVCache,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden] float32 -> (last MLP output, residual stream), each [T, hidden]
        p = meta.paged
        assert p is not None, "the decoder stack reads AttentionMetadata.paged"
        t = x.shape[0]
        cos, sin = rotary
        heads, kv_heads, head_dim, eps = self.shape
        return tuple(self._ops.decoder_stack(
            x, self.norms, self.blocks, self.qtypes, self.outputs, self.parts, cache.k, cache.v,
            cos.view(t, -1), sin.view(t, -1), heads, kv_heads, head_dim, eps, meta.slot_mapping,
            p.seq_offsets, p.prefix, p.prefix_offsets, p.local, p.local_offsets, p.causal,
            self.scale, self.int8))


def _matrices(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    """A layer's four matrices in `decoder_stack`'s order."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _pieces(matrix: nn.Module) -> list[nn.Module]:
    """A matrix's kernel calls: itself, or a GGUFStack's parts (outputs side by side)."""
    from ngramspec.layers.gguf_linear import GGUFStack

    return list(matrix.parts) if isinstance(matrix, GGUFStack) else [matrix]


def _layer_fits(layer: DecoderLayer, eps: float) -> bool:
    """Whether the stack's calls are this layer's: fused CPU ops everywhere, one rank, no q/k
    norm, and GGUF matrices (or stacks of them) on the vector kernels (not AMX tiles) without bias."""
    from ngramspec.layers.gguf_linear import GGUFLinear

    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (all(isinstance(m, GGUFLinear) and not m.uses_amx and m.bias is None
                for matrix in _matrices(layer) for m in _pieces(matrix))
            and attn.q_norm is None and attn.ops is not None and mlp.ops is not None
            and attn.all_reduce is None and mlp.all_reduce is None
            and all(n.ops is not None and n.eps == eps for n in norms))
