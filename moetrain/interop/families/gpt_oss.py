"""gpt-oss (``gpt_oss``): grouped-query attention with q/k/v/o biases and a learned sink
logit per head, sliding-window layers alternating with full ones (``layer_types``), YaRN
without truncation, a router with a bias whose softmax runs over the top-k logits (the
renormalised top-k of a softmax), and experts with biases and the clamped SwiGLU, gate and
up projections interleaved in one tensor (``gate_up_proj[..., ::2]`` / ``[..., 1::2]``).
Every layer MoE, no shared experts. Published checkpoints store the experts in MXFP4
(``*_blocks`` / ``*_scales``): dequantized on import (``moetrain.interop.mxfp4``); export
writes them dequantized."""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families.base import Family, need
from moetrain.interop.sources import Interleaved, Mxfp4Experts, Rows, Source
from moetrain.model.transformer import is_moe_layer

SLIDING, FULL = "sliding_attention", "full_attention"


class GptOss(Family):
    model_type, architecture = "gpt_oss", "GptOssForCausalLM"
    gpt_oss_options = True

    def to_moetrain(self, hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        quant = hf.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "mxfp4":
            raise HFCheckpointError(
                f"config.json: {self.model_type}: quantization {quant.get('quant_method')!r} "
                "is not supported (MXFP4 experts are dequantized on import)"
            )
        model, moe = super().to_moetrain(hf)
        n = model["n_layers"]
        types = hf.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n)]
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown or len(types) != n:
            raise HFCheckpointError(
                f"config.json: {self.model_type}: layer_types must list {n} of {SLIDING!r} / "
                f"{FULL!r}, got {types}"
            )
        sliding = [i for i, t in enumerate(types) if t == SLIDING]
        window = hf.get("sliding_window")
        bias = bool(hf.get("attention_bias", True))
        model.update(
            qkv_bias=bias,
            out_bias=bias,
            attention_sinks=True,
            sliding_window=window if sliding and window else None,
            sliding_window_layers=sliding if sliding and window and len(sliding) < n else None,
        )
        moe.update(
            num_experts=need(hf, "num_local_experts", self.model_type),
            top_k=need(hf, "num_experts_per_tok", self.model_type),
            expert_ffn_dim=need(hf, "intermediate_size", self.model_type),
            renormalize=True,  # softmax over the top-k logits
            router_bias=True,
            expert_ffn_bias=True,
            expert_activation="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        )
        return model, moe

    def sliding_window(self, hf: dict) -> int | None:
        return None  # expressed per layer (model.sliding_window_layers), never a cap

    def to_hf(self, m: ModelConfig, e: MoEConfig) -> dict[str, Any]:
        out = super().to_hf(m, e)
        scaling = out.pop("rope_scaling")
        # transformers 5's format: gpt-oss's config puts its own YaRN default in place of a
        # missing one, so plain RoPE is written out as such.
        out["rope_parameters"] = {"rope_theta": out.pop("rope_theta"),
                                  **(scaling or {"rope_type": "default"})}  # fmt: skip
        layers = range(m.n_layers)
        window = [m.window(i) for i in layers]
        out.update(
            attention_bias=True,
            intermediate_size=e.expert_ffn_dim,
            num_local_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            swiglu_alpha=e.swiglu_alpha,
            swiglu_limit=e.swiglu_limit,
            layer_types=[SLIDING if w is not None else FULL for w in window],
            sliding_window=m.sliding_window,
            router_aux_loss_coef=e.aux_loss_coef,
            output_router_logits=False,
        )
        return out

    def problems(self, m: ModelConfig, e: MoEConfig) -> list[str]:
        out = []
        if m.attention != "gqa":
            out.append("multi-head latent attention")
        if m.partial_rotary_factor != 1.0:
            out.append("partial rotary")
        if m.qk_norm != "none":
            out.append("q/k norms")
        if m.clip_qkv is not None:
            out.append("clip_qkv")
        if not (m.qkv_bias and m.out_bias):
            out.append("attention without q/k/v/o biases (gpt-oss has them)")
        if not m.attention_sinks:
            out.append("attention without sinks")
        if m.mtp_depth:
            out.append("multi-token prediction")
        if e.num_experts == 0:
            return [*out, "no MoE layers"]
        if e.num_shared_experts:
            out.append("shared experts")
        if any(not is_moe_layer(i, e) for i in range(m.n_layers)):
            out.append("dense layers")
        if e.score_func != "softmax" or not e.renormalize:
            out.append("routing other than the renormalised softmax top-k")
        if e.n_groups > 1:
            out.append("group-limited routing")
        if e.routed_scaling_factor != 1.0:
            out.append("routed_scaling_factor")
        if e.selects_with_bias:
            out.append("an expert selection bias")
        if not (e.router_bias and e.expert_ffn_bias):
            out.append("no router or expert biases (gpt-oss has them)")
        if e.expert_activation != "clamped_swiglu":
            out.append(f"the {e.expert_activation} expert activation")
        return out

    def attention_sources(self, i: int, m: ModelConfig) -> dict[str, Source]:
        out = super().attention_sources(i, m)
        p, q = f"{self.prefix}.{i}.self_attn", f"layers.{i}.attention"
        out[f"{q}.sinks"] = Rows(f"{p}.sinks", (m.n_heads,))
        return out

    def moe_sources(self, i: int, m: ModelConfig, e: MoEConfig) -> dict[str, Source]:
        p, q = f"{self.prefix}.{i}.mlp", f"layers.{i}.ffn"
        E, D, F = e.num_experts, m.dim, e.expert_ffn_dim
        up = f"{p}.experts.gate_up_proj"
        return {
            f"{q}.router.gate.weight": Rows(f"{p}.router.weight", (E, D)),
            f"{q}.router.gate.bias": Rows(f"{p}.router.bias", (E,)),
            f"{q}.experts.w1": Interleaved(up, (E, D, F), 0),
            f"{q}.experts.w3": Interleaved(up, (E, D, F), 1),
            f"{q}.experts.w2": Rows(f"{p}.experts.down_proj", (E, F, D)),
            f"{q}.experts.b1": Interleaved(f"{up}_bias", (E, F), 0),
            f"{q}.experts.b3": Interleaved(f"{up}_bias", (E, F), 1),
            f"{q}.experts.b2": Rows(f"{p}.experts.down_proj_bias", (E, D)),
        }

    def read_sources(self, m: ModelConfig, e: MoEConfig, tensors: set[str]) -> dict[str, Source]:
        """MXFP4 experts where the directory holds them packed (the published checkpoints),
        dequantized to bf16 on reading, as transformers dequantizes them."""
        out = self.sources(m, e)
        for i in range(m.n_layers):
            p, q = f"{self.prefix}.{i}.mlp.experts", f"layers.{i}.ffn.experts"
            if f"{p}.gate_up_proj_blocks" not in tensors:
                continue
            E, D, F = e.num_experts, m.dim, e.expert_ffn_dim
            out[f"{q}.w1"] = Mxfp4Experts(f"{p}.gate_up_proj", (E, D, F), 0, torch.bfloat16)
            out[f"{q}.w3"] = Mxfp4Experts(f"{p}.gate_up_proj", (E, D, F), 1, torch.bfloat16)
            out[f"{q}.w2"] = Mxfp4Experts(f"{p}.down_proj", (E, F, D), None, torch.bfloat16)
        return out
