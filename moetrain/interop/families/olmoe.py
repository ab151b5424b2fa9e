"""OLMoE: q/k RMSNorm over the whole projections, clip_qkv, no renormalisation."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family, need
from moetrain.model.transformer import is_moe_layer


class Olmoe(Family):
    model_type, architecture = "olmoe", "OlmoeForCausalLM"

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        bias = bool(hf.get("attention_bias", False))
        clip = hf.get("clip_qkv")
        model.update(
            qk_norm="full",
            qkv_bias=bias,
            out_bias=bias,
            clip_qkv=float(clip) if clip is not None else None,
        )
        if model["head_dim"] is not None:
            raise HFCheckpointError(
                "config.json: olmoe: head_dim must be hidden_size / num_attention_heads"
            )
        moe.update(
            num_experts=need(hf, "num_experts", self.model_type),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=hf["intermediate_size"],
            renormalize=bool(hf.get("norm_topk_prob", False)),
        )
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["head_dim"]
        out.update(
            attention_bias=m.qkv_bias,
            clip_qkv=m.clip_qkv,
            intermediate_size=e.expert_ffn_dim,
            num_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            norm_topk_prob=e.renormalize,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "full":
            out.append(f"qk_norm={m.qk_norm} (OLMoE normalises whole projections)")
        if m.head_dim is not None:
            out.append("head_dim other than dim / n_heads")
        if m.qkv_bias != m.out_bias:
            out.append("q/k/v biases without an output bias (or the reverse)")
        if e.num_shared_experts:
            out.append("shared experts")
        if e.num_experts and any(not is_moe_layer(i, e) for i in range(m.n_layers)):
            out.append("dense layers")
        return out
