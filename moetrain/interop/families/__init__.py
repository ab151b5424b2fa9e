"""One small adapter per Hugging Face family (docs/interop.md).

MoE families: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5, MiniMax-M2,
DeepSeek-V2, gpt-oss. Dense families (the sources
of sparse upcycling, and plain dense imports): Llama, Mistral, Qwen2, Qwen3. Tensor names
are those ``save_pretrained`` writes (the per-expert layout of the Hub checkpoints).
``moetrain``: moetrain's own model with its modeling file beside the weights, what export
writes when no family expresses a checkpoint (``families/moetrain.py``).
"""

from __future__ import annotations

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import ARCH_MODEL_KEYS, ARCH_MOE_KEYS, Family
from moetrain.interop.families.deepseek_v2 import DeepseekV2
from moetrain.interop.families.deepseek_v3 import DeepseekV3
from moetrain.interop.families.dense import Llama, Mistral, Qwen2, Qwen3
from moetrain.interop.families.glm4_moe import Glm4Moe
from moetrain.interop.families.gpt_oss import GptOss
from moetrain.interop.families.minimax_m2 import MiniMaxM2
from moetrain.interop.families.mixtral import Mixtral
from moetrain.interop.families.moetrain import Moetrain
from moetrain.interop.families.olmoe import Olmoe
from moetrain.interop.families.qwen2_moe import Qwen2Moe
from moetrain.interop.families.qwen3_moe import Qwen3Moe

__all__ = [
    "ARCH_MODEL_KEYS",
    "ARCH_MOE_KEYS",
    "DENSE_FAMILIES",
    "FAMILIES",
    "MOE_FAMILIES",
    "Family",
    "export_family",
    "family_of",
]

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Mixtral(),
        Qwen3Moe(),
        Olmoe(),
        Qwen2Moe(),
        DeepseekV3(),
        Glm4Moe(),
        MiniMaxM2(),
        DeepseekV2(),
        GptOss(),
        Llama(),
        Mistral(),
        Qwen2(),
        Qwen3(),
        Moetrain(),  # last: a family is preferred whenever one expresses the model
    )
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe",
                "minimax_m2", "deepseek_v2", "gpt_oss")  # fmt: skip
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def family_of(hf: dict, key: str = "HF_DIR") -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise HFCheckpointError(
            f"{key}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(MOE_FAMILIES)} (MoE), {', '.join(DENSE_FAMILIES)} (dense) and moetrain "
            "(moetrain's own, as export-hf writes it)"
        )
    return FAMILIES[model_type]


def export_family(
    m: ModelConfig, e: MoEConfig, prefer: str | None = None
) -> tuple[Family, list[str]]:
    """The first family that expresses these sections (``prefer`` first; ``moetrain``, which
    expresses every model, last) and why each family tried before it could not."""
    order = ([prefer] if prefer in FAMILIES else []) + [t for t in FAMILIES if t != prefer]
    reasons = []
    for t in order:
        problems = FAMILIES[t].cannot_express(m, e)
        if not problems:
            return FAMILIES[t], reasons
        reasons.append(f"{t}: {', '.join(problems)}")
    raise HFCheckpointError("no family expresses this architecture: " + "; ".join(reasons))
