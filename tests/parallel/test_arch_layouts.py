"""The architecture options of the Hugging Face families under every parallel axis.

Option sets, each the micro MoE of ``tests/multirank.py`` with one family's options:

- Qwen-style: head_dim unrelated to the width, rotate-half RoPE with YaRN, per-head q/k
  RMSNorm, q/k/v and output biases, clip_qkv, a sigmoid-gated shared expert, a dense layer;
- OLMoE-style: q/k RMSNorm over the whole projections (split over tp: the weight is sharded
  and the mean of squares reduced over tp ranks), clip_qkv;
- DeepSeek-V3-style: multi-head latent attention with q LoRA and YaRN (its softmax scale),
  sigmoid routing with the score-correction bias, two expert groups of which a token may use
  one, routed_scaling_factor, a first dense layer;
- GLM-4.5-style: partial rotary over half of each head, per-head q/k norms, q/k/v biases
  without an output bias, DeepSeek-V3's routing;
- MiniMax-M2-style: whole-projection q/k norms with a head_dim unrelated to the width,
  partial rotary, biased sigmoid routing without shared experts;
- DeepSeek-V2-style: MLA without q LoRA, softmax routing over groups scored by their best
  expert, no renormalisation, routed_scaling_factor;
- gpt-oss-style: attention sinks (split with the heads under tp), q/k/v/o biases, a head
  width unrelated to the width, sliding-window layers between full ones, untruncated YaRN,
  a router bias, expert biases (the gate/up ones split with the experts' width, the down
  one added once after the combine) and the clamped SwiGLU with a limit the micro model
  reaches.

Each trains ``STEPS`` fp32 steps under tp=2 + sequence parallelism, pp=2 and ep=2 with ZeRO-3
(one spawned 2-rank job) and must reproduce the single-process run on every rank: losses,
router statistics, every gradient and AdamW moment, final parameters, layout facts
(``check_cases`` and the tolerances of ``tests/multirank.py``). The DeepSeek set under tp
also proves the gradient all-reduce of the shared RoPE key (without it the run drifts;
checked when the hook was written).
"""

from __future__ import annotations

import pytest
from multirank import Case, check_cases

STEPS = 2

OPTION_SETS: dict[str, list[str]] = {
    "qwen": [
        "model.head_dim=32", "model.rope_style=half", "model.rope_scaling=yarn",
        "model.rope_scaling_factor=4.0", "model.rope_original_max_seq_len=16",
        "model.qk_norm=head", "model.qkv_bias=true", "model.out_bias=true",
        "model.clip_qkv=4.0", "moe.shared_expert_gate=true", "moe.dense_layers=[1]",
    ],
    "olmoe": ["model.qk_norm=full", "model.clip_qkv=2.0", "model.rope_style=half"],
    "deepseek": [
        "model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
        "model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
        "model.rope_original_max_seq_len=16", "model.rope_yarn_mscale=1.0",
        "model.rope_yarn_mscale_all_dim=1.0", "moe.score_func=sigmoid",
        "moe.route_with_bias=true", "moe.n_groups=2", "moe.topk_groups=1",
        "moe.routed_scaling_factor=2.5", "moe.dense_layers=[0]",
    ],
    "glm-4.5": [
        "model.partial_rotary_factor=0.5", "model.rope_style=half", "model.qk_norm=head",
        "model.qkv_bias=true", "moe.score_func=sigmoid", "moe.route_with_bias=true",
        "moe.n_groups=2", "moe.topk_groups=1", "moe.routed_scaling_factor=2.5",
        "moe.dense_layers=[0]",
    ],
    "minimax-m2": [
        "model.qk_norm=full", "model.head_dim=32", "model.partial_rotary_factor=0.5",
        "model.rope_style=half", "moe.score_func=sigmoid", "moe.route_with_bias=true",
        "moe.num_shared_experts=0",
    ],
    "gpt-oss": [
        "model.attention_sinks=true", "model.qkv_bias=true", "model.out_bias=true",
        "model.head_dim=8", "model.sliding_window=5", "model.sliding_window_layers=[0,2]",
        "model.rope_style=half", "model.rope_scaling=yarn", "model.rope_scaling_factor=32.0",
        "model.rope_original_max_seq_len=4096", "model.rope_yarn_truncate=false",
        "moe.router_bias=true", "moe.expert_ffn_bias=true",
        "moe.expert_activation=clamped_swiglu", "moe.swiglu_alpha=1.702",
        "moe.swiglu_limit=0.5", "moe.num_shared_experts=0", "moe.expert_bias_rate=0.0",
    ],
    "deepseek-v2": [
        "model.attention=mla", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
        "model.qk_rope_head_dim=8", "model.v_head_dim=16", "moe.renormalize=false",
        "moe.n_groups=2", "moe.topk_groups=1", "moe.group_score=max",
        "moe.routed_scaling_factor=2.0", "moe.expert_bias_rate=0.0", "moe.dense_layers=[0]",
    ],
}  # fmt: skip

LAYOUTS: dict[str, list[str]] = {
    "tp=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp=2 1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "ep=2 + zero3": ["parallel.ep=2", "parallel.zero_stage=3"],
}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_family_options_reproduce_one_process_under_tp_pp_ep_zero3() -> None:
    """Whole option sets of the families (more than the pairs the equivalence matrix crosses,
    tests/parallel/test_matrix.py), on the oracle of every layout test: every rank, every
    gradient, the layout facts."""
    cases = [
        Case(f"{family} / {layout}", tuple(lo), tuple(opts))
        for family, opts in OPTION_SETS.items()
        for layout, lo in LAYOUTS.items()
    ]
    check_cases(2, cases, STEPS, timeout=560)
