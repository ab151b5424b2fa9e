"""MiniMax-M2 (``minimax_m2``): grouped-query attention with q/k RMSNorm over the whole
projections, partial rotary (``rotary_dim`` of each head), and sigmoid routing with a
score-correction bias (``block_sparse_moe.e_score_correction_bias``), renormalised; every
layer MoE, no shared experts."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.families.mixtral import Mixtral
from moetrain.interop.sources import Rows, Source
from moetrain.model.transformer import is_moe_layer


class MiniMaxM2(Mixtral):
    """Mixtral's tensor names and expert keys, with MiniMax-M2's attention and routing."""

    model_type, architecture = "minimax_m2", "MiniMaxM2ForCausalLM"
    partial_rotary = True

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if hf.get("rotary_dim"):  # the released checkpoints' way of saying partial rotary
            model["partial_rotary_factor"] = hf["rotary_dim"] / head_dim
        model.update(qk_norm="full")
        moe.update(score_func="sigmoid", renormalize=True, route_with_bias=True)
        return model, moe

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["sliding_window"]
        out.update(rotary_dim=m.rope_dim, partial_rotary_factor=m.partial_rotary_factor)
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = []
        if m.attention != "gqa":
            out.append("multi-head latent attention")
        if m.qk_norm != "full":
            out.append(f"qk_norm={m.qk_norm} (MiniMax-M2 normalises whole projections)")
        if m.qkv_bias or m.out_bias:
            out.append("attention biases")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if m.mtp_depth:
            out.append("multi-token prediction")
        if e.num_experts == 0:
            return [*out, "no MoE layers"]
        if e.num_shared_experts:
            out.append("shared experts")
        if any(not is_moe_layer(i, e) for i in range(m.n_layers)):
            out.append("dense layers")
        if e.score_func != "sigmoid":
            out.append("softmax router scores")
        if not e.renormalize:
            out.append("renormalize=false")
        if e.n_groups > 1:
            out.append("group-limited routing")
        if e.routed_scaling_factor != 1.0:
            out.append("routed_scaling_factor")
        if not e.selects_with_bias:
            out.append("routing without the score-correction bias")
        return out

    def moe_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        out = super().moe_sources(i, m, e)
        p, q = f"{self.prefix}.{i}.{self.moe_block}", f"layers.{i}.ffn"
        out[f"{q}.router.expert_bias"] = Rows(f"{p}.e_score_correction_bias", (e.num_experts,))
        return out
