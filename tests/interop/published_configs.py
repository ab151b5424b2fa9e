"""config.json of the published checkpoints that configs/*.yaml describe, as the Hugging Face
Hub serves them (copied by hand; nothing is downloaded). DeepSeek-V3's fp8
``quantization_config`` is left out: moetrain reads bf16/fp32 weights only; so is gpt-oss's
MXFP4 one (moetrain dequantizes those experts as it reads them, tests/interop/test_mxfp4.py),
which transformers would apply to a model built from the config."""

from __future__ import annotations

PUBLISHED: dict[str, dict] = {
    "olmoe_1b_7b.yaml": {  # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "eos_token_id": 50279,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe",
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
        "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False, "vocab_size": 50304,
    },
    "qwen3_30b_a3b.yaml": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "mixtral_8x7b.yaml": {  # mistralai/Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 32000,
    },
    "deepseek_v3.yaml": {  # deepseek-ai/DeepSeek-V3
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
        "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    },
    "gpt_oss_20b.yaml": {  # openai/gpt-oss-20b
        "architectures": ["GptOssForCausalLM"], "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss",
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
        "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 201088,
    },
}  # fmt: skip

# openai/gpt-oss-120b: gpt-oss-20b's config.json but for its depth and expert count.
PUBLISHED["gpt_oss_120b.yaml"] = {
    **PUBLISHED["gpt_oss_20b.yaml"],
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}
