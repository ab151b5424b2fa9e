"""moetrain's own model as a transformers model: the export of last resort.

When no Hugging Face family expresses a checkpoint's architecture (moetrain's default MoE
with its aux-loss-free expert bias, an upcycled Qwen2 with attention biases and no shared
expert, any option no family has), ``export-hf`` writes it with this adapter: config.json
(``model_type: moetrain``, the architecture keys of both sections under ``moetrain_model``
and ``moetrain_moe``, ``auto_map``) and beside the weights the modeling and config files of
``hf_remote/``, which transformers loads with ``trust_remote_code=True``. Tensor names are
moetrain's own (``model.layers.{i}.attention.wq.weight``, grouped experts as (E, D, F)),
and RoPE keeps the checkpoint's pairing, so export and import copy tensors unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import ARCH_MODEL_KEYS, ARCH_MOE_KEYS, Family, _defaults
from moetrain.interop.sources import Rows, Source

REMOTE_DIR = Path(__file__).resolve().parent.parent / "hf_remote"
REMOTE_FILES = ("configuration_moetrain.py", "modeling_moetrain.py")


def hf_name(name: str) -> str:
    """The transformers name of a moetrain state-dict name."""
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    return f"model.{name}"


class Moetrain(Family):
    model_type, architecture = "moetrain", "MoetrainForCausalLM"
    keeps_rope_style = True
    remote_files = REMOTE_FILES
    mtp = True
    gpt_oss_options = True

    def hf_mtp_depth(self, hf: dict, tensors: set[str]) -> int:
        return int((hf.get("moetrain_model") or {}).get("mtp_depth") or 0)

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        sections = []
        for key, cls, names in (("moetrain_model", ModelConfig, ARCH_MODEL_KEYS),
                                ("moetrain_moe", MoEConfig, ARCH_MOE_KEYS)):  # fmt: skip
            values = hf.get(key)
            if not isinstance(values, dict):
                raise HFCheckpointError(f"config.json: moetrain needs the object {key!r}")
            unknown = sorted(set(values) - set(names))
            if unknown:
                raise HFCheckpointError(
                    f"config.json: {key} has keys this moetrain version does not know: "
                    f"{', '.join(unknown)}"
                )
            defaults = _defaults(cls)
            sections.append({k: values.get(k, defaults[k]) for k in names})
        return sections[0], sections[1]

    def sliding_window(self, hf: dict) -> int | None:
        return None

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        moe = {k: getattr(e, k) for k in ARCH_MOE_KEYS}
        # A bias that moved in training selects experts at inference as a frozen one.
        moe["route_with_bias"] = e.selects_with_bias
        moe["dense_layers"] = list(e.dense_layers)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "auto_map": {
                "AutoConfig": "configuration_moetrain.MoetrainConfig",
                "AutoModel": "modeling_moetrain.MoetrainModel",
                "AutoModelForCausalLM": "modeling_moetrain.MoetrainForCausalLM",
            },
            "moetrain_model": {k: getattr(m, k) for k in ARCH_MODEL_KEYS},
            "moetrain_moe": moe,
            "vocab_size": m.vocab_size,
            "hidden_size": m.dim,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.kv_heads,
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std,
            "use_cache": True,
        }

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        return []

    def sources(self, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        from moetrain.model import meta_model

        model = meta_model(m, e)
        out: dict[str, Source] = {}
        for name, t in model.state_dict().items():
            key = "model.embed_tokens.weight" if name == "output.weight" and m.tie_embeddings \
                else hf_name(name)  # fmt: skip
            out[name] = Rows(key, tuple(t.shape))
        return out
