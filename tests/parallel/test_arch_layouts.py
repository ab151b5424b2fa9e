"""The architecture options of the Hugging Face families under every parallel axis.

Three option sets, each the micro MoE of ``tests/multirank.py`` with one family's options:

- Qwen-style: head_dim unrelated to the width, rotate-half RoPE with YaRN, per-head q/k
  RMSNorm, q/k/v and output biases, clip_qkv, a sigmoid-gated shared expert, a dense layer;
- OLMoE-style: q/k RMSNorm over the whole projections (split over tp: the weight is sharded
  and the mean of squares reduced over tp ranks), clip_qkv;
- DeepSeek-V3-style: multi-head latent attention with q LoRA and YaRN (its softmax scale),
  sigmoid routing with the score-correction bias, two expert groups of which a token may use
  one, routed_scaling_factor, a first dense layer.

Each trains ``STEPS`` fp32 steps under tp=2 + sequence parallelism, pp=2 and ep=2 with ZeRO-3
(one spawned 2-rank job) and must reproduce the single-process run: losses, router
statistics, every gradient and AdamW moment, final parameters (tolerances of
``tests/multirank.py``). The DeepSeek set under tp also proves the gradient all-reduce of
the shared RoPE key (without it the run drifts; checked when the hook was written).
"""

from __future__ import annotations

import tempfile

import pytest
from multirank import compare_runs, micro_run, run_ranks

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
}  # fmt: skip

LAYOUTS: dict[str, list[str]] = {
    "tp=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp=2 1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "ep=2 + zero3": ["parallel.ep=2", "parallel.zero_stage=3"],
}


def _worker(rank: int, world_size: int, runs: list[list[str]]) -> list[dict] | None:
    results = []
    for overrides in runs:
        with tempfile.TemporaryDirectory() as out:
            results.append(micro_run(out, STEPS, *overrides))
    return results if rank == 0 else None


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_family_options_reproduce_one_process_under_tp_pp_ep_zero3() -> None:
    refs = {}
    for name, options in OPTION_SETS.items():
        with tempfile.TemporaryDirectory() as out:
            refs[name] = micro_run(out, STEPS, *options)
    cases = [(o, lay) for o in OPTION_SETS for lay in LAYOUTS]
    runs = [OPTION_SETS[o] + LAYOUTS[lay] for o, lay in cases]
    results = run_ranks(_worker, 2, runs, timeout=850)[0]
    failures = []
    for (options, layout), got in zip(cases, results, strict=True):
        what = f"{options} options, {layout}"
        try:
            errs = compare_runs(got, refs[options], what=what)
        except AssertionError as exc:
            failures.append(f"{what}: {exc}")
        else:
            print(f"{what}: max abs errors {errs}")
    assert not failures, "\n\n".join(failures)
