"""Qwen3-MoE: per-head q/k RMSNorm, head_dim independent of the width, norm_topk_prob,
mlp_only_layers / decoder_sparse_step."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family, need


class Qwen3Moe(Family):
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        bias = bool(hf.get("attention_bias", False))
        model.update(qk_norm="head", qkv_bias=bias, out_bias=bias)
        moe.update(
            num_experts=hf.get("num_experts", hf.get("num_local_experts")),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=need(hf, "moe_intermediate_size", self.model_type),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            every_n_layers=int(hf.get("decoder_sparse_step", 1)),
            dense_layers=sorted(hf.get("mlp_only_layers") or []),
        )
        if not moe["num_experts"]:
            raise HFCheckpointError(f"config.json: {self.model_type} needs 'num_experts'")
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        out.update(
            attention_bias=m.qkv_bias,
            moe_intermediate_size=e.expert_ffn_dim,
            num_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            norm_topk_prob=e.renormalize,
            decoder_sparse_step=e.every_n_layers,
            mlp_only_layers=list(e.dense_layers),
            use_sliding_window=False,
            sliding_window=None,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "head":
            out.append(f"qk_norm={m.qk_norm} (Qwen3 normalises per head)")
        if m.qkv_bias != m.out_bias:
            out.append("q/k/v biases without an output bias (or the reverse)")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if e.num_shared_experts:
            out.append("shared experts")
        return out
