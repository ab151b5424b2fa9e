"""The option side of the equivalence matrix: every model / MoE / training option as a factor
with its values, each value a list of config overrides on top of ``multirank.MICRO``.

``tests/parallel/test_matrix.py`` crosses these with the layouts. A new model or router option
joins the matrix by adding a factor here (or a value to an existing one); a combination the
code refuses goes in ``forbidden`` with the reason, and validation must refuse it too.
"""

from __future__ import annotations

# name -> [(value label, overrides)]; the first value of each factor is the MICRO baseline.
FACTORS: dict[str, list[tuple[str, list[str]]]] = {
    "embeddings": [
        ("untied", ["model.tie_embeddings=false"]),
        ("tied", ["model.tie_embeddings=true"]),
    ],
    "moe_every": [
        ("every layer", ["moe.every_n_layers=1"]),
        ("every 2nd layer", ["moe.every_n_layers=2"]),
    ],
    "shared_experts": [
        ("1 shared", ["moe.num_shared_experts=1"]),
        ("none", ["moe.num_shared_experts=0"]),
    ],
    "capacity": [
        ("cf1 probs", ["moe.capacity_factor=1.0", "moe.drop_policy=probs"]),
        ("dropless", ["moe.capacity_factor=null"]),
        ("cf1 position", ["moe.capacity_factor=1.0", "moe.drop_policy=position"]),
        ("cf1.25 padded", ["moe.capacity_factor=1.25", "moe.pad_to_capacity=true"]),
    ],
    "score_func": [
        ("softmax", ["moe.score_func=softmax"]),
        ("sigmoid", ["moe.score_func=sigmoid"]),
    ],
    "renormalize": [
        ("renorm", ["moe.renormalize=true"]),
        ("no renorm", ["moe.renormalize=false"]),
    ],
    "jitter": [
        ("no jitter", ["moe.jitter_eps=0.0"]),
        ("jitter", ["moe.jitter_eps=0.1"]),
    ],
    "aux_loss": [
        ("switch aux", ["moe.aux_loss_coef=0.01"]),
        ("no switch aux", ["moe.aux_loss_coef=0.0"]),
    ],
    "seq_aux_loss": [
        ("seq aux", ["moe.seq_aux_loss_coef=0.001"]),
        ("no seq aux", ["moe.seq_aux_loss_coef=0.0"]),
    ],
    "z_loss": [
        ("z-loss", ["moe.z_loss_coef=0.001"]),
        ("no z-loss", ["moe.z_loss_coef=0.0"]),
    ],
    "expert_bias": [
        ("bias 0.01", ["moe.expert_bias_rate=0.01"]),
        ("no bias", ["moe.expert_bias_rate=0.0"]),
    ],
    "token_groups": [
        ("groups of 2", ["moe.token_group_seqs=2"]),
        ("whole micro-batch", ["moe.token_group_seqs=null"]),
    ],
    "accumulation": [
        ("micro-batch 2", ["train.micro_batch_size=2"]),
        ("micro-batch 1", ["train.micro_batch_size=1", "moe.token_group_seqs=1"]),
    ],
    "activation_checkpointing": [
        ("no AC", ["parallel.activation_checkpointing=none"]),
        ("selective AC", ["parallel.activation_checkpointing=selective"]),
        ("full AC", ["parallel.activation_checkpointing=full"]),
    ],
    # The architecture options of the Hugging Face families (docs/interop.md).
    "attention": [
        ("gqa", ["model.attention=gqa"]),
        ("gqa head_dim, per-head q/k norm, biases (Qwen3, Qwen2)",
         ["model.head_dim=32", "model.qk_norm=head", "model.qkv_bias=true",
          "model.out_bias=true"]),
        ("whole-projection q/k norm, clip_qkv (OLMoE)",
         ["model.qk_norm=full", "model.clip_qkv=2.0"]),
        ("mla (DeepSeek-V3)",
         ["model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
          "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16"]),
    ],
    "rope": [
        ("interleaved", ["model.rope_style=interleaved", "model.rope_scaling=none"]),
        ("half", ["model.rope_style=half"]),
        ("yarn", ["model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
                  "model.rope_original_max_seq_len=16", "model.rope_yarn_mscale=1.0",
                  "model.rope_yarn_mscale_all_dim=1.0"]),
        ("llama3", ["model.rope_scaling=llama3", "model.rope_scaling_factor=8.0",
                    "model.rope_original_max_seq_len=16"]),
    ],
    "routing": [
        ("plain top-k", ["moe.n_groups=1"]),
        ("DeepSeek-V3: sigmoid, score-correction bias, groups, scaling",
         ["moe.score_func=sigmoid", "moe.route_with_bias=true", "moe.n_groups=2",
          "moe.topk_groups=1", "moe.routed_scaling_factor=2.5"]),
    ],
    "dense_layers": [
        ("none", ["moe.dense_layers=[]"]),
        ("first layer dense", ["moe.dense_layers=[0]"]),
    ],
    "shared_expert_gate": [
        ("ungated", ["moe.shared_expert_gate=false"]),
        ("sigmoid-gated (Qwen2-MoE)", ["moe.shared_expert_gate=true"]),
    ],
}  # fmt: skip

FORBIDDEN: list[tuple[dict[str, str], str]] = [
    (
        {"shared_expert_gate": "sigmoid-gated (Qwen2-MoE)", "shared_experts": "none"},
        "moe.shared_expert_gate needs moe.num_shared_experts > 0",
    ),
]
"""(factor -> value label, reason): value combinations validation refuses."""
