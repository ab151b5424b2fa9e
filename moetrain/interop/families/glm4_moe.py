"""GLM-4.5 / 4.6 (``glm4_moe``): grouped-query attention with q/k/v biases (no output bias),
optional per-head q/k RMSNorm and partial rotary (the first half of each head by default),
and DeepSeek-V3's routing: sigmoid scores with the correction bias, groups scored by their
two best experts, renormalisation, routed_scaling_factor, shared experts, the first k
layers dense. Its multi-token-prediction layers (``num_nextn_predict_layers``, DeepSeek-V3's
layout) are read and written as ``model.mtp_depth``; transformers drops them."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.families.base import Family
from moetrain.interop.families.deepseek_v3 import DeepseekV3
from moetrain.interop.sources import Source


class Glm4Moe(DeepseekV3):
    model_type, architecture = "glm4_moe", "Glm4MoeForCausalLM"
    partial_rotary = True

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        hf = {"partial_rotary_factor": 0.5, **hf}  # transformers' default for GLM-4.5
        self.check_routing(hf)
        model, moe = Family.to_moetrain(self, hf)
        model.update(
            qkv_bias=bool(hf.get("attention_bias", False)),
            out_bias=False,
            qk_norm="head" if hf.get("use_qk_norm") else "none",
        )
        moe.update(self.moe_keys(hf, model["n_layers"]))
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = Family.to_hf(self, m, e)
        out.update(
            attention_bias=m.qkv_bias,
            use_qk_norm=m.qk_norm == "head",
            partial_rotary_factor=m.partial_rotary_factor,
            **self.moe_to_hf(e),
        )
        del out["scoring_func"], out["topk_method"]
        out["num_nextn_predict_layers"] = m.mtp_depth
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = []
        if m.attention != "gqa":
            out.append("multi-head latent attention")
        if m.qk_norm == "full":
            out.append("qk_norm=full (GLM-4.5 normalises per head)")
        if m.out_bias:
            out.append("an attention output bias")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if e.num_experts and e.num_shared_experts == 0:
            out.append("no shared expert (GLM-4.5 always has one)")
        return out + self.moe_problems(e)

    def attention_sources(self, i: int, m: ModelConfig) -> dict[str, Source]:
        return Family.attention_sources(self, i, m)
