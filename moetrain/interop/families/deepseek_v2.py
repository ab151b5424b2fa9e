"""DeepSeek-V2 (``deepseek_v2``): DeepSeek-V3's multi-head latent attention (always in the
interleaved RoPE pairing) with softmax routing: greedy top-k, or group-limited
(``topk_method: group_limited_greedy``, each group scored by its best expert), no
renormalisation (transformers' DeepSeek-V2 does none), routed_scaling_factor, shared
experts, the first k layers dense; no score-correction bias."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family
from moetrain.interop.families.deepseek_v3 import DeepseekV3
from moetrain.interop.sources import Source


class DeepseekV2(DeepseekV3):
    model_type, architecture = "deepseek_v2", "DeepseekV2ForCausalLM"
    mtp = False

    def check_routing(self, hf: dict) -> None:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise HFCheckpointError(f"config.json: deepseek_v2: topk_method {method!r} is not "
                                    "supported (greedy and group_limited_greedy are)")  # fmt: skip
        if hf.get("norm_topk_prob"):
            raise HFCheckpointError(
                "config.json: deepseek_v2: norm_topk_prob=true is not supported "
                "(transformers' DeepSeek-V2 does not renormalise)"
            )

    def moe_keys(self, hf: dict, n_layers: int) -> dict[str, Any]:
        out = super().moe_keys(hf, n_layers)
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        groups = int(hf.get("n_group") or 1) if grouped else 1
        out.update(
            score_func="softmax",
            renormalize=False,
            route_with_bias=False,
            n_groups=groups,
            topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
            group_score="max",
        )
        return out

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["rope_interleave"], out["scoring_func"], out["num_nextn_predict_layers"]
        out.update(
            topk_method="group_limited_greedy" if e.n_groups > 1 else "greedy",
            norm_topk_prob=False,
            mlp_bias=False,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = []
        if m.attention != "mla":
            out.append("grouped-query attention (DeepSeek-V2 uses MLA)")
        if m.rope_style != "interleaved":
            out.append("rotate-half RoPE (DeepSeek-V2 pairs interleaved dims)")
        if m.tie_embeddings:
            out.append("tied embeddings")
        if m.mtp_depth:
            out.append("multi-token prediction")
        if e.num_experts == 0:
            return [*out, "no MoE layers"]
        if e.score_func != "softmax":
            out.append(f"{e.score_func} router scores")
        if e.renormalize:
            out.append("renormalize=true")
        if e.selects_with_bias:
            out.append("an expert selection bias")
        if e.n_groups > 1 and e.group_score != "max":
            out.append("groups scored by their two best experts (DeepSeek-V2 uses the best)")
        return out + self.layer_problems(e)

    def moe_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        return Family.moe_sources(self, i, m, e)
