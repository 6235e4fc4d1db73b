"""The model registry: `config.architectures[0]` names the class that runs a checkpoint."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from worker.config import EAGLE3_ARCHITECTURES
from worker.kernels import Kernels
from worker.models.eagle3 import Eagle3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.mixtral import MixtralForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM
from worker.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from worker.parallel import TPGroup

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    # draft heads (speculative_method eagle3), served only beside the model they draft for
    **{arch: Eagle3ForCausalLM for arch in EAGLE3_ARCHITECTURES},
}
# what a user may serve on its own, as errors list them (a draft head is not one)
SERVED_ARCHITECTURES = tuple(sorted(arch for arch in MODELS if arch not in EAGLE3_ARCHITECTURES))


class UnsupportedModelError(ValueError):
    pass


def build_model(config: PretrainedConfig, max_positions: int, tp: TPGroup, kernels: Kernels = Kernels()) -> nn.Module:
    """`kernels`: which of the layers' kernels run (each layer keeps its own choice)."""
    archs = getattr(config, "architectures", None) or []
    if isinstance(archs, str):  # iterated, its letters would be named as architectures
        raise UnsupportedModelError(f'config.json\'s "architectures" is a list of names: write ["{archs}"]')
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch](config, max_positions, tp, kernels)
    raise UnsupportedModelError(
        f"unsupported architecture {archs or config.model_type!r}; supported: {list(SERVED_ARCHITECTURES)}"
    )
