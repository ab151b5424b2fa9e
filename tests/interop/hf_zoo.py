"""Tiny random transformers models of every supported family, saved with save_pretrained.

Nothing is downloaded: each model is built from a config here, with weights drawn from a
fixed seed. Routers get larger weights than transformers' init (and DeepSeek-V3 a random
score-correction bias) so that routing is decisive and differs from token to token: a
model that picked the wrong experts could not agree on the logits by accident.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096
"""The default moetrain tokenizer's vocabulary: the same dirs serve the training tests."""

_ATTN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.05, vocab_size=VOCAB,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip

CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(_ATTN, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2, rope_theta=1e6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_ATTN, num_hidden_layers=3, head_dim=32,
                                         intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", dict(_ATTN, intermediate_size=32, num_experts=8,
                                  num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=8.0)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_ATTN, intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        _ATTN, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "glm4_moe": ("Glm4MoeConfig", dict(
        _ATTN, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5)),
    "minimax_m2": ("MiniMaxM2Config", dict(_ATTN, head_dim=32, rotary_dim=16,
                                           intermediate_size=32, num_local_experts=8,
                                           num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", dict(
        _ATTN, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        first_k_dense_replace=1, routed_scaling_factor=2.0, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "gpt_oss": ("GptOssConfig", dict(
        _ATTN, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, swiglu_alpha=1.5, swiglu_limit=0.4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})),
}  # fmt: skip
"""model_type -> (transformers config class, its arguments). Each exercises its family's
options: Qwen3 a head_dim unrelated to the width and a dense mlp_only layer; OLMoE no
renormalisation and clip_qkv; Qwen2 biases and a gated shared expert; DeepSeek-V3 MLA with
q LoRA, group-limited sigmoid routing, scaling, a first dense layer and YaRN; GLM-4.5 q/k/v
biases, per-head q/k norms, partial rotary and V3's routing; MiniMax-M2 whole-projection q/k
norms, a head_dim unrelated to the width, partial rotary (rotary_dim) and biased sigmoid
routing; DeepSeek-V2 MLA without q LoRA, YaRN and softmax routing over groups scored by
their best expert; gpt-oss sinks, sliding layers (window 6 < the tests' sequences)
alternating with full ones, YaRN without truncation (gpt-oss's own, whose correction range
has fractional ends with this head width), router and expert biases and a clamped
SwiGLU whose limit the tiny model's activations reach."""

DENSE: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(_ATTN, intermediate_size=96, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(_ATTN, intermediate_size=96, sliding_window=None)),
    "qwen3": ("Qwen3Config", dict(_ATTN, head_dim=32, intermediate_size=96,
                                  tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(_ATTN, intermediate_size=96)),
}  # fmt: skip
"""Dense families (sparse-upcycling sources)."""

MODELS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
          "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
          "deepseek_v3": "DeepseekV3ForCausalLM", "llama": "LlamaForCausalLM",
          "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
          "minimax_m2": "MiniMaxM2ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
          "gpt_oss": "GptOssForCausalLM"}  # fmt: skip


def build_hf(model_type: str, seed: int = 0):
    """A tiny random transformers model of ``model_type`` (fp32, eval mode)."""
    import transformers

    cls_name, kwargs = {**CONFIGS, **DENSE}[model_type]
    cfg = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, MODELS[model_type])(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in routers(model):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.3)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)  # a router's or the block's
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.1)
            # gpt-oss: sinks, the router's bias, the experts' biases (zeros or tiny by init).
            for name in ("sinks", "gate_up_proj_bias", "down_proj_bias"):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            if type(module).__name__ == "GptOssTopKRouter":
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.3)
    return model


def save_hf(model_type: str, path: Path, seed: int = 0):
    model = build_hf(model_type, seed)
    model.save_pretrained(path)
    return model


def routers(model) -> list:
    """The transformers router modules of ``model``, in layer order."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def save_tokenizer(path: Path) -> None:
    """moetrain's default BPE (vocabulary VOCAB) as the directory's tokenizer files."""
    import json

    from moetrain.data import load_tokenizer

    tok = load_tokenizer("default")
    assert tok.vocab_size <= VOCAB
    (path / "tokenizer.json").write_text(tok._tok.to_str())
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
