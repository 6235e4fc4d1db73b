"""EAGLE-3 draft heads in their published format (`LlamaForCausalLMEagle3`): one Llama decoder layer that
reads the model's own hidden states. Its input at position p is the next token, t[p + 1], with the
model's residual stream at p taken at three of its layers (low, middle, high; `aux_layer_ids`) and
projected to one width by `fc`. The model computes that projection itself, as it goes (the head's `fc`
lent to it: worker/models/llama.py AuxHidden), and keeps it for every token beside its KV cache: a third
of the bytes the three hidden states would take. The layer attends over the concatenation of the normed token embedding
and the normed hidden state (twice the width, so its q, k and v projections are twice as wide). Each
further position it drafts goes on from its own output before the final norm (the "prenorm" hidden
state) instead of the model's. Its LM head covers a smaller vocabulary (`draft_vocab_size`), each of
its ids mapped to the model's by the offsets in `d2t`. A head ships without token embeddings as a
rule: it shares the model's.

Checkpoint names as published: `midlayer.*` (the layer), `fc.weight`, `norm.weight`, `lm_head.weight`,
`d2t`, `t2d` (unused), and `embed_tokens.weight` where a head has its own."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from worker.attention.base import AttentionBackend
from worker.checkpoint_error import CheckpointError
from worker.config import EAGLE3_ARCHITECTURES
from worker.kernels import Kernels
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import QKVParallelLinear
from worker.layers.mlp import SwiGLU
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.loader import safetensors_files
from worker.models.llama import Attention, AuxHidden, head_dim_of
from worker.parallel import TPGroup


class Eagle3ConfigError(ValueError):
    """An EAGLE-3 head that does not fit the model it is to draft for."""


def is_eagle3(config: PretrainedConfig) -> bool:
    return any(arch in EAGLE3_ARCHITECTURES for arch in getattr(config, "architectures", None) or [])


def aux_layer_ids(head: PretrainedConfig, num_layers: int) -> tuple[int, int, int]:
    """The model's layers whose input (the residual stream before them) the head reads: as the head's
    config names them (`eagle_aux_hidden_state_layer_ids`, at its top or in `eagle_config`), else the
    published default (2, L // 2, L - 3) for a model of L layers."""
    eagle = getattr(head, "eagle_config", None) or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise Eagle3ConfigError(
            "the head's eagle_config has use_aux_hidden_state false (it reads the model's last hidden state "
            "alone, as EAGLE-1 and -2 heads do): only EAGLE-3 heads, reading three layers, are served"
        )
    ids = getattr(head, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_layers // 2, num_layers - 3)
        where = f"the default for {num_layers} layers"
    else:
        where = "eagle_aux_hidden_state_layer_ids"
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise Eagle3ConfigError(
            f"the EAGLE-3 head reads the model's layers {list(ids)} ({where}); it needs three of the "
            f"model's {num_layers} layers (0..{num_layers - 1}): set eagle_aux_hidden_state_layer_ids in its config"
        )
    return ids


def target_hidden_size(head: PretrainedConfig) -> int:
    return getattr(head, "target_hidden_size", None) or head.hidden_size


def _find_tensor(folder: str, names: tuple[str, ...]) -> tuple[Path, str] | None:
    """The file of the folder's safetensors holding the first of `names` it holds, and that name."""
    for path in safetensors_files(Path(folder)):
        with safe_open(str(path), framework="pt") as f:
            name = next((n for n in names if n in f.keys()), None)
            if name is not None:
                return path, name
    return None


def _read_tensor(folder: str, names: tuple[str, ...]) -> torch.Tensor | None:
    found = _find_tensor(folder, names)
    if found is None:
        return None
    with safe_open(str(found[0]), framework="pt") as f:
        return f.get_tensor(found[1])


def has_own_embeddings(folder: str) -> bool:
    """Whether the head's checkpoint holds token embeddings (most share the model's)."""
    return _find_tensor(folder, ("embed_tokens.weight",)) is not None


class Eagle3Layer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        self.self_attn = Attention(config, 0, rotary, tp, (bias, bias), False, kernels)
        # q, k and v read the normed embedding and hidden state side by side
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden,
            head_dim_of(config),
            config.num_attention_heads,
            config.num_key_value_heads,
            bias,
            tp,
            kernels,
        )
        self.mlp = SwiGLU(hidden, config.intermediate_size, tp, kernels)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, kernels)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, kernels)
        # some heads were trained with the residual taken after the hidden state's norm
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, positions, attn)
        return self.mlp.forward_after_norm(self.post_attention_layernorm, x, residual)


class Eagle3Model(nn.Module):
    def __init__(
        self, config: PretrainedConfig, max_positions: int, tp: TPGroup, kernels: Kernels, own_embeddings: bool
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, kernels)
        # None until the model's are lent (Eagle3ForCausalLM.share_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if own_embeddings else None
        )
        self.layers = nn.ModuleList([Eagle3Layer(config, rotary, tp, kernels)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class Eagle3ForCausalLM(nn.Module):
    """The head as a model of its own engine (rank 0's, beside the model's). The engine hands each step's
    rows to `forward` with where their hidden states come from; `slot_hidden` keeps each request's last
    prenorm hidden state, by slot, for the next drafted position."""

    takes_hidden = True
    packed = {
        "midlayer": ("model.layers.0", 0),
        "layers": ("model.layers", 0),  # some heads name their layer layers.0
        "norm": ("model.norm", 0),
        "embed_tokens": ("model.embed_tokens", 0),
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    checkpoint_buffers = ("d2t",)  # loaded as tensors of the checkpoint, though not parameters
    optional = ("d2t",)  # absent where the head's vocabulary is the model's
    ignored = ("t2d", "fc.weight")  # fc: the model's to apply (head_fc)

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup, kernels: Kernels = Kernels()) -> None:
        super().__init__()
        self.config = config
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        own = bool(getattr(config, "embed_tokens_in_checkpoint", True))
        self.model = Eagle3Model(config, max_positions, tp, kernels, own)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size, tp, kernels)
        # target id = draft id + d2t[draft id]
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.aux_source: torch.Tensor | None = None  # the model's projected hidden states [KV cells, hidden]
        self.slot_hidden: torch.Tensor | None = None  # [slots, hidden]
        self._target_ids: torch.Tensor | None = None  # each draft id's model id; None: the same ids

    def attach(self, target) -> None:
        """Once its weights are loaded: reads from now on the hidden states that `target` (rank 0's Engine
        of the model) keeps, and its token embeddings (whole) where the head has none of its own."""
        self.aux_source = target.aux_hidden
        if self.model.embed_tokens is None:
            embed = model_embeddings(target)
            if embed.weight.shape[-1] != self.config.hidden_size:
                raise Eagle3ConfigError(
                    f"the EAGLE-3 head is {self.config.hidden_size} wide and has no token embeddings of its own; "
                    f"the model's are {embed.weight.shape[-1]} wide"
                )
            self.model.embed_tokens = embed
        identity = self.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any())
        if not identity:
            self._target_ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def allocate_state(self, num_slots: int) -> None:
        weight = self.model.norm.weight
        self.slot_hidden = torch.zeros(num_slots, self.config.hidden_size, dtype=weight.dtype, device=weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        hidden_loc: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        last_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of a step's tokens. An extend step (`last_idx`: each row's last token)
        reads the model's hidden states at `hidden_loc` (zeros without them: the engine's warm-up); a
        decode step (one token a row) goes on from each row's last prenorm hidden state. Either way
        each row's last prenorm hidden state is kept for its slot."""
        m = self.model
        if hidden_loc is not None:
            hidden = self.aux_source.index_select(0, hidden_loc)
        elif last_idx is not None:
            hidden = self.slot_hidden.new_zeros(len(input_ids), self.config.hidden_size)
        else:
            hidden = self.slot_hidden.index_select(0, slots)
        x, residual = m.layers[0](m.embed_tokens(input_ids), hidden, positions, attn)
        normed, prenorm = m.norm.of_stream(x, residual)
        last = prenorm if last_idx is None else prenorm.index_select(0, last_idx)
        self.slot_hidden.index_copy_(0, slots, last.to(self.slot_hidden.dtype))
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the model's vocabulary: the head's own at their mapped ids, -inf elsewhere."""
        logits = self.lm_head(hidden).float()
        if self._target_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self._target_ids] = logits
        return full


def model_embeddings(target) -> VocabParallelEmbedding:
    """Rank 0's token embeddings of the model (`target`, its Engine), whole: its own module at tp 1, else
    read from its checkpoint (each rank holds a shard)."""
    embed = target.model.model.embed_tokens
    if target.tp.size == 1:
        return embed
    return load_embeddings(target.config.model_path, target.hf_config, embed.weight.dtype, embed.weight.device)


def load_embeddings(
    folder: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device
) -> VocabParallelEmbedding:
    """The model's token embeddings, whole, from its safetensors checkpoint (for a head beside a model
    whose ranks each hold a shard of them)."""
    weight = _read_tensor(folder, ("model.embed_tokens.weight", "embed_tokens.weight"))
    if weight is None:
        raise CheckpointError(
            f"the EAGLE-3 head has no token embeddings and none were found in {folder}'s safetensors: give the "
            "head its own (embed_tokens.weight) or serve the model at tensor_parallel_size 1"
        )
    with torch.device("meta"):
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, TPGroup())
    embed.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    return embed


def head_fc(
    folder: str, config: PretrainedConfig, dummy: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The head's fc weight [hidden, 3 x the model's hidden], which the model applies: from its checkpoint,
    or random (load_format dummy, as the engine draws random weights)."""
    shape = (config.hidden_size, 3 * target_hidden_size(config))
    if dummy:
        gen = torch.Generator(device=device).manual_seed(0)
        return torch.empty(shape, dtype=dtype, device=device).uniform_(-0.02, 0.02, generator=gen)
    fc = _read_tensor(folder, ("fc.weight",))
    if fc is None:
        raise CheckpointError(f"the EAGLE-3 head in {folder} has no fc.weight")
    if tuple(fc.shape) != shape:
        raise CheckpointError(f"the EAGLE-3 head in {folder}: fc.weight is {tuple(fc.shape)}, its config says {shape}")
    return fc.to(device=device, dtype=dtype)


def keep_hidden_states(model: nn.Module, head: PretrainedConfig, folder: str, cells: int, dummy: bool) -> torch.Tensor:
    """Has `model` (built, on its device) keep for every token, at its KV cell (of `cells`), the hidden
    state the head in `folder` (its config `head`) reads: fc of its three layers' residual streams.
    Returns that cache."""
    config = model.config
    layers = aux_layer_ids(head, config.num_hidden_layers)
    if target_hidden_size(head) != config.hidden_size:
        raise CheckpointError(
            f"the EAGLE-3 head in {folder} reads hidden states {target_hidden_size(head)} wide; "
            f"the model's are {config.hidden_size}"
        )
    weight = model.model.norm.weight
    fc = head_fc(folder, head, dummy, weight.dtype, weight.device)
    cache = torch.empty(cells, head.hidden_size, dtype=weight.dtype, device=weight.device)
    model.model.aux = AuxHidden.of(layers, fc, cache)
    return cache
