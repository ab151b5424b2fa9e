"""Dense families, the sources of sparse upcycling: Llama, Mistral, Qwen2, Qwen3."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family


class Llama(Family):
    model_type, architecture = "llama", "LlamaForCausalLM"
    moe = False

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        if hf.get("mlp_bias"):
            raise HFCheckpointError(f"config.json: {self.model_type}: mlp_bias is not supported")
        model, moe = super().to_moetrain(hf)
        bias = bool(hf.get("attention_bias", False))
        model.update(qkv_bias=bias, out_bias=bias)
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        return {**super().to_hf(m, e), "attention_bias": m.qkv_bias, "mlp_bias": False}

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "none":
            out.append("q/k norms")
        if m.qkv_bias != m.out_bias:
            out.append("q/k/v biases without an output bias (or the reverse)")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        return out


class Mistral(Llama):
    model_type, architecture = "mistral", "MistralForCausalLM"

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = Family.to_hf(self, m, e)
        out["sliding_window"] = None
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qkv_bias or m.out_bias:
            out.append("attention biases")
        return out


class Qwen2(Family):
    model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    moe = False

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        model.update(qkv_bias=True)
        return model, moe

    def sliding_window(self, hf: dict) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window", False) else None

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["head_dim"]
        return {**out, "use_sliding_window": False}

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if not m.qkv_bias or m.out_bias or m.qk_norm != "none" or m.clip_qkv is not None:
            out.append("attention other than Qwen2's (q/k/v biases only)")
        if m.head_dim is not None:
            out.append("head_dim other than dim / n_heads")
        return out


class Qwen3(Family):
    model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    moe = False

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        bias = bool(hf.get("attention_bias", False))
        model.update(qk_norm="head", qkv_bias=bias, out_bias=bias)
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        return {**out, "attention_bias": m.qkv_bias, "use_sliding_window": False}

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "head" or m.qkv_bias != m.out_bias or m.clip_qkv is not None:
            out.append("attention other than Qwen3's (per-head q/k norms)")
        return out
