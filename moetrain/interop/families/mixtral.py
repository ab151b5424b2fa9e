"""Mixtral: softmax top-k over every layer's experts, renormalised; no shared experts."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.families.base import Family, need
from moetrain.model.transformer import is_moe_layer


class Mixtral(Family):
    model_type, architecture = "mixtral", "MixtralForCausalLM"
    moe_block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        moe.update(
            num_experts=need(hf, "num_local_experts", self.model_type),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=hf["intermediate_size"],
            renormalize=True,
        )
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        out.update(
            intermediate_size=e.expert_ffn_dim,
            num_local_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "none":
            out.append("q/k norms")
        if m.qkv_bias or m.out_bias:
            out.append("attention biases")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if e.num_shared_experts:
            out.append("shared experts")
        if not e.renormalize:
            out.append("renormalize=false")
        if e.num_experts and any(not is_moe_layer(i, e) for i in range(m.n_layers)):
            out.append("dense layers")
        return out
