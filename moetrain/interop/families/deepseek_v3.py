"""DeepSeek-V3: multi-head latent attention (q and kv LoRA, decoupled RoPE part), sigmoid
scores with the score-correction bias, group-limited routing, routed_scaling_factor,
first_k_dense_replace dense layers, shared experts, YaRN."""

from __future__ import annotations

from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family, need
from moetrain.interop.sources import Rows, Source


class DeepseekV3(Family):
    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"
    mtp = True

    def check_routing(self, hf: dict) -> None:
        if (
            hf.get("scoring_func", "sigmoid") != "sigmoid"
            or hf.get("topk_method", "noaux_tc") != "noaux_tc"
        ):
            raise HFCheckpointError(
                f"config.json: {self.model_type}: only scoring_func=sigmoid with "
                "topk_method=noaux_tc (DeepSeek-V3's routing) is supported"
            )

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        if hf.get("quantization_config"):
            raise HFCheckpointError(
                f"config.json: {self.model_type}: quantized (fp8) checkpoints are "
                "not supported; dequantize to bf16 first"
            )
        if hf.get("attention_bias"):
            raise HFCheckpointError(
                f"config.json: {self.model_type}: attention_bias is not supported"
            )
        self.check_routing(hf)
        model, moe = super().to_moetrain(hf)
        model.update(
            head_dim=None,
            n_kv_heads=None,
            attention="mla",
            rope_style="interleaved" if hf.get("rope_interleave", True) else "half",
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=need(hf, "kv_lora_rank", self.model_type),
            qk_nope_head_dim=need(hf, "qk_nope_head_dim", self.model_type),
            qk_rope_head_dim=need(hf, "qk_rope_head_dim", self.model_type),
            v_head_dim=need(hf, "v_head_dim", self.model_type),
        )
        moe.update(self.moe_keys(hf, model["n_layers"]))
        return model, moe

    def moe_keys(self, hf: dict, n_layers: int) -> dict[str, Any]:
        """The moe section of DeepSeek-V3-style routing: sigmoid scores, the correction bias,
        groups scored by their two best experts, shared experts, the first k layers dense."""
        every = int(hf.get("moe_layer_freq", 1))
        if every != 1:
            raise HFCheckpointError(
                f"config.json: {self.model_type}: moe_layer_freq != 1 is not supported"
            )
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        groups = int(hf.get("n_group") or 1)
        return dict(
            num_experts=need(hf, "n_routed_experts", self.model_type),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=need(hf, "moe_intermediate_size", self.model_type),
            dense_layers=list(range(min(first_dense, n_layers))),
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            shared_expert_ffn_dim=None,
            score_func="sigmoid",
            renormalize=bool(hf.get("norm_topk_prob", True)),
            route_with_bias=True,
            n_groups=groups,
            topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )

    def sliding_window(self, hf: dict) -> int | None:
        return None

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        del out["head_dim"]
        out.update(
            num_key_value_heads=m.n_heads,
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_interleave=m.rope_style == "interleaved",
            attention_bias=False,
            **self.moe_to_hf(e),
        )
        out["num_nextn_predict_layers"] = m.mtp_depth
        return out

    def moe_to_hf(self, e: MoEConfig) -> dict[str, Any]:
        return dict(
            moe_intermediate_size=e.expert_ffn_dim,
            n_routed_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            n_shared_experts=e.num_shared_experts,
            first_k_dense_replace=len(e.dense_layers),
            n_group=e.n_groups,
            topk_group=e.topk_groups,
            norm_topk_prob=e.renormalize,
            routed_scaling_factor=e.routed_scaling_factor,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            num_nextn_predict_layers=0,
        )

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = []
        if m.attention != "mla":
            out.append("grouped-query attention (DeepSeek-V3 uses MLA)")
        if m.tie_embeddings:
            out.append("tied embeddings")
        return out + self.moe_problems(e)

    def moe_problems(self, e: MoEConfig) -> list[str]:
        if e.num_experts == 0:
            return ["no MoE layers"]
        out = []
        if e.score_func != "sigmoid":
            out.append("softmax router scores")
        out += self.layer_problems(e)
        if e.n_groups == 1 and e.topk_groups != 1:
            out.append("topk_groups without groups")
        if e.group_score != "top2":
            out.append("groups scored by their best expert (DeepSeek-V3 sums the two best)")
        if not e.selects_with_bias:
            out.append("routing without the score-correction bias")
        return out

    @staticmethod
    def layer_problems(e: MoEConfig) -> list[str]:
        """The DeepSeek layout of MoE layers: the first k dense, ungated shared experts of
        num_shared_experts * expert_ffn_dim."""
        out = []
        if e.every_n_layers != 1 or e.dense_layers != list(range(len(e.dense_layers))):
            out.append("dense layers other than the first k")
        if e.shared_expert_gate:
            out.append("a shared-expert gate")
        if e.num_shared_experts and e.shared_expert_ffn_dim not in (
            None,
            e.num_shared_experts * e.expert_ffn_dim,
        ):
            out.append("shared_expert_ffn_dim other than num_shared_experts * expert_ffn_dim")
        return out

    def attention_sources(self, i: int, m: ModelConfig) -> dict[str, Source]:
        assert m.kv_lora_rank and m.qk_nope_head_dim and m.qk_rope_head_dim and m.v_head_dim
        p, q = f"{self.prefix}.{i}.self_attn", f"layers.{i}.attention"
        H, D, C, R = m.n_heads, m.dim, m.kv_lora_rank, m.qk_rope_head_dim
        qk = m.qk_nope_head_dim + R
        out: dict[str, Source] = {
            f"{q}.wkv_a.weight": Rows(f"{p}.kv_a_proj_with_mqa.weight", (C, D), 0, C + R),
            f"{q}.wk_rope.weight": Rows(f"{p}.kv_a_proj_with_mqa.weight", (R, D), C, C + R),
            f"{q}.kv_norm.weight": Rows(f"{p}.kv_a_layernorm.weight", (C,)),
            f"{q}.wkv_b.weight": Rows(
                f"{p}.kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), C)
            ),
            f"{q}.wo.weight": Rows(f"{p}.o_proj.weight", (D, H * m.v_head_dim)),
        }
        if m.q_lora_rank is None:
            out[f"{q}.wq.weight"] = Rows(f"{p}.q_proj.weight", (H * qk, D))
        else:
            out[f"{q}.wq_a.weight"] = Rows(f"{p}.q_a_proj.weight", (m.q_lora_rank, D))
            out[f"{q}.q_norm.weight"] = Rows(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,))
            out[f"{q}.wq_b.weight"] = Rows(f"{p}.q_b_proj.weight", (H * qk, m.q_lora_rank))
        return out

    def moe_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        out = super().moe_sources(i, m, e)
        p, q = f"{self.prefix}.{i}.mlp", f"layers.{i}.ffn"
        out[f"{q}.router.expert_bias"] = Rows(f"{p}.gate.e_score_correction_bias", (e.num_experts,))
        return out

    def shared_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        if not e.num_shared_experts:
            return {}
        p, q = f"{self.prefix}.{i}.mlp", f"layers.{i}.ffn"
        S = e.num_shared_experts * e.expert_ffn_dim
        return {
            f"{q}.shared_experts.w1.weight": Rows(
                f"{p}.shared_experts.gate_proj.weight", (S, m.dim)
            ),
            f"{q}.shared_experts.w3.weight": Rows(f"{p}.shared_experts.up_proj.weight", (S, m.dim)),
            f"{q}.shared_experts.w2.weight": Rows(
                f"{p}.shared_experts.down_proj.weight", (m.dim, S)
            ),
        }
