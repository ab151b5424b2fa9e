"""Qwen2-MoE: q/k/v biases and a shared expert behind its own sigmoid gate."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.families.base import Family, need
from moetrain.interop.sources import Rows, Source


class Qwen2Moe(Family):
    model_type, architecture = "qwen2_moe", "Qwen2MoeForCausalLM"

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        model, moe = super().to_moetrain(hf)
        model.update(qkv_bias=bool(hf.get("qkv_bias", True)))
        moe.update(
            num_experts=need(hf, "num_experts", self.model_type),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=need(hf, "moe_intermediate_size", self.model_type),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            every_n_layers=int(hf.get("decoder_sparse_step", 1)),
            dense_layers=sorted(hf.get("mlp_only_layers") or []),
            num_shared_experts=1,
            shared_expert_ffn_dim=need(hf, "shared_expert_intermediate_size", self.model_type),
            shared_expert_gate=True,
        )
        return model, moe

    def sliding_window(self, hf: dict) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window", False) else None

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["head_dim"]
        out.update(
            qkv_bias=m.qkv_bias,
            moe_intermediate_size=e.expert_ffn_dim,
            shared_expert_intermediate_size=e.shared_expert_ffn_dim
            or e.num_shared_experts * e.expert_ffn_dim,
            num_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            norm_topk_prob=e.renormalize,
            decoder_sparse_step=e.every_n_layers,
            mlp_only_layers=list(e.dense_layers),
            use_sliding_window=False,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = super().problems(m, e)
        if m.qk_norm != "none":
            out.append("q/k norms")
        if m.out_bias:
            out.append("an attention output bias")
        if m.head_dim is not None:
            out.append("head_dim other than dim / n_heads")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if e.num_shared_experts == 0 or not e.shared_expert_gate:
            out.append("no gated shared expert (Qwen2-MoE always has one)")
        return out

    def shared_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        p, q = f"{self.prefix}.{i}.mlp", f"layers.{i}.ffn"
        S = e.shared_expert_ffn_dim or e.num_shared_experts * e.expert_ffn_dim
        return {
            f"{q}.shared_experts.w1.weight": Rows(
                f"{p}.shared_expert.gate_proj.weight", (S, m.dim)
            ),
            f"{q}.shared_experts.w3.weight": Rows(f"{p}.shared_expert.up_proj.weight", (S, m.dim)),
            f"{q}.shared_experts.w2.weight": Rows(
                f"{p}.shared_expert.down_proj.weight", (m.dim, S)
            ),
            f"{q}.shared_expert_gate.weight": Rows(f"{p}.shared_expert_gate.weight", (1, m.dim)),
        }
