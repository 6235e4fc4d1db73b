"""The Llama decoder, which Qwen2 (qkv bias) and Qwen3 (q/k norm, explicit head_dim) extend by flags, and
the mixtures of experts by their feed-forward block (`mlp_of`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from worker import triton_ops
from worker.attention.base import AttentionBackend
from worker.kernels import Kernels
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import QKVParallelLinear, RowParallelLinear
from worker.layers.mlp import SwiGLU
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.layers.row_fusion import linear_add, norm_linear
from worker.parallel import TPGroup


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        bias: tuple[bool, bool],
        qk_norm: bool,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        qkv_bias, o_bias = bias
        self.layer_id = layer_id
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            qkv_bias,
            tp,
            kernels,
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias, tp=tp, kernels=kernels
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.rotary = rotary
        self.kernels = kernels

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, attn)[0]

    def attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention from the projected q, k and v on, through o_proj: (its output, residual), or (its output
        plus residual, None) where o_proj's GEMV adds it (row_fusion.linear_add)."""
        # norm, rotary and the KV write in one kernel
        if triton_ops.prologue_applies(self.kernels, qkv, self.head_dim, attn.kv.dtype):
            q = self._fused_prologue(qkv, positions, attn.out_loc, attn)
            out = attn.forward(q, None, None, self.layer_id)  # keys and values are in the cache already
        else:
            out = attn.forward(*self._qkv(qkv, positions), self.layer_id)
        return linear_add(self.o_proj, out.reshape(-1, self.num_heads * self.head_dim), residual, self.kernels)

    def warm_prologue(self, attn: AttentionBackend, scratch_loc: int, dtype: torch.dtype) -> None:
        """Runs the fused prologue once at the first token count of each of its tiles
        (triton_ops.PROLOGUE_TILE_STARTS), every token writing the KV cell at scratch_loc, with the tensors'
        dtypes of an eager step: a prompt of another tile would otherwise compile its variant in a live step."""
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        device = attn.kv.device
        if not triton_ops.prologue_applies(
            self.kernels, torch.empty(1, width, dtype=dtype, device=device), self.head_dim, attn.kv.dtype
        ):
            return
        for tokens in triton_ops.PROLOGUE_TILE_STARTS:
            self._fused_prologue(
                torch.zeros(tokens, width, dtype=dtype, device=device),
                torch.zeros(tokens, dtype=torch.int64, device=device),
                torch.full((tokens,), scratch_loc, dtype=torch.int64, device=device),
                attn,
            )

    def _fused_prologue(
        self, qkv: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The Triton prologue: q/k norm and rotary, the keys and values written at out_loc; the queries."""
        norm = self.q_norm is not None
        return triton_ops.qkv_prologue(
            qkv,
            positions,
            out_loc,
            self.rotary.cos_sin,
            self.q_norm.weight if norm else None,
            self.k_norm.weight if norm else None,
            self.q_norm.eps if norm else 0.0,
            attn.kv.k(self.layer_id),
            attn.kv.v(self.layer_id),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            pdl=triton_ops.pdl_applies(self.kernels, qkv.device),
        )

    def _qkv(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unfused prologue: split, q/k norm, rotary."""
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


# a layer's feed-forward block: (config, layer_id, tp, kernels) -> a module that all-reduces its output and
# takes its input through `forward_after_norm(norm, x, residual)` (SwiGLU, SparseMoeBlock)
MlpOf = Callable[[PretrainedConfig, int, TPGroup, Kernels], nn.Module]


def dense_mlp(config: PretrainedConfig, layer_id: int, tp: TPGroup, kernels: Kernels) -> nn.Module:
    return SwiGLU(config.hidden_size, config.intermediate_size, tp, kernels)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        bias: tuple[bool, bool],
        qk_norm: bool,
        kernels: Kernels,
        mlp_of: MlpOf = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary, tp, bias, qk_norm, kernels)
        self.mlp = mlp_of(config, layer_id, tp, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.kernels = kernels

    def forward(self, x, residual, positions, attn):
        # each residual norm runs inside the GEMV after it at one row, and in an FP8 model the residual add
        # inside the GEMV before it (worker/layers/row_fusion.py): then residual is None between them, x the
        # whole residual stream
        qkv, residual, _ = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual, self.kernels)
        x, residual = self.self_attn.attend(qkv, positions, attn, residual)
        return self.mlp.forward_after_norm(self.post_attention_layernorm, x, residual)

    def norm_folds(self) -> list[tuple[RMSNorm, nn.Module]]:
        """(norm, the one linear that reads its output) pairs, whose norm weight may fold into the linear's
        input columns (worker/quant/fold.py): the input norm and qkv; the post-attention norm and a dense
        SwiGLU's gate-up (a mixture of experts' router and experts both read it)."""
        folds = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, SwiGLU):
            folds.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return folds


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        tp: TPGroup,
        bias: tuple[bool, bool],
        qk_norm: bool,
        kernels: Kernels,
        mlp_of: MlpOf = dense_mlp,
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, kernels)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, tp, bias, qk_norm, kernels, mlp_of) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # an EAGLE-3 head drafting beside this model (worker/models/eagle3.py) reads the residual stream
        # before three layers, projected by its fc: kept for every token at its KV cell
        self.aux: AuxHidden | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x, residual, aux, projected = self.embed_tokens(input_ids), None, self.aux, None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in aux.weights:
                part = F.linear(x if residual is None else x + residual, aux.weights[i])
                projected = part if projected is None else projected + part
                if i == aux.last:  # a prompt's prefix-cache hits keep theirs, with their KV
                    aux.cache.index_copy_(0, attn.out_loc, projected)
            x, residual = layer(x, residual, positions, attn)
        return self.norm.of_stream(x, residual)[0]


@dataclass
class AuxHidden:
    """What a model keeps for an EAGLE-3 head: fc(concat(h[a], h[b], h[c])) of each token, h[i] the
    residual stream before layer i, computed as the sum of each layer's slice of fc (one GEMM a layer;
    a layer named twice has its slices summed), into cache [KV cells, the head's width]."""

    weights: dict[int, torch.Tensor]
    last: int
    cache: torch.Tensor

    @classmethod
    def of(cls, layer_ids: tuple[int, ...], fc: torch.Tensor, cache: torch.Tensor) -> AuxHidden:
        """`fc`: the head's [width, len(layer_ids) * hidden]."""
        slices = fc.chunk(len(layer_ids), dim=1)
        weights: dict[int, torch.Tensor] = {}
        for layer, w in zip(layer_ids, slices):
            weights[layer] = w.contiguous() if layer not in weights else weights[layer] + w
        return cls(weights, max(layer_ids), cache)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    mlp_of: MlpOf = staticmethod(dense_mlp)
    # checkpoint names of the parts fused into one of our weights (or renamed): (our name, shard id)
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup, kernels: Kernels = Kernels()) -> None:
        super().__init__()
        self.config = config
        attention_bias = getattr(config, "attention_bias", False)
        # Llama's attention_bias covers q, k, v and o; Qwen2 has a bias on q, k and v only
        bias = (self.qkv_bias or attention_bias, attention_bias and not self.qkv_bias)
        self.model = DecoderModel(config, max_positions, tp, bias, self.qk_norm, kernels, self.mlp_of)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, kernels)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Returns the final hidden states of every token; `compute_logits` projects the ones that sample."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
