"""The option side of the equivalence matrix: every model / MoE / training option as a factor
with its values, each value a list of config overrides on top of ``multirank.MICRO``.

``tests/parallel/test_matrix.py`` crosses these with the layouts. A new model or router option
joins the matrix by adding a factor here (or a value to an existing one); a combination the
code refuses goes in ``forbidden`` with the reason, and validation must refuse it too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from short_docs import short_docs_dataset

STEPS = 2  # tests/parallel/matrix_design.py: the optimizer steps of every cell


def replay_dir() -> str:
    """A directory of routing-replay files (``train.routing_replay``) for the cells: the
    first ``STEPS`` global batches of the micro config (its data: data.seq_len 16, batches
    of 8) with a fixed random routing -- two distinct experts of 4 per token in each of the 4
    layers, drawn from a seeded generator. Made once per machine and data (the default
    corpus depends on the Python version), published atomically."""
    import sys

    import torch

    key = hashlib.sha1(f"{sys.version_info[:3]}:{STEPS}:v1".encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / f"moetrain-matrix-replay-{key}"
    if (root / f"step_{STEPS:08d}.pt").is_file():
        return str(root)
    from moetrain.config import load_config
    from moetrain.data import PackedBatches, load_tokenizer
    from moetrain.train.replay import save_record

    cfg = load_config(None, ["data.seq_len=16"])
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    data = PackedBatches(cfg.data, tok, "train", 8, 8)
    gen = torch.Generator().manual_seed(14)
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    for step in range(1, STEPS + 1):
        inputs = data.next_step()[0]["input_ids"]
        ids = {layer: torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8 * 16)])
               for layer in range(4)}  # fmt: skip
        record = {"input_ids": inputs, "ids": {k: v.view(8, 16, 2) for k, v in ids.items()}}
        save_record(staging, step, record, num_experts=4, top_k=2, loss=float("nan"))
    try:
        os.rename(staging, root)
    except OSError:  # another process published it first
        shutil.rmtree(staging, ignore_errors=True)
    return str(root)


REPLAY = replay_dir()
SHORT_DOCS = short_docs_dataset()  # sequences of 16 tokens that pack several documents

# name -> [(value label, overrides)]; the first value of each factor is the baseline (the
# micro MoE of tests/multirank.py). Factors are kept to two or three values each -- a
# four-valued factor alone would need 16 rows per layout for its pairs with another one --
# so a pairwise covering design per layout stays small (tests/parallel/matrix_design.py).
FACTORS: dict[str, list[tuple[str, list[str]]]] = {
    # model
    "embeddings": [("untied", ["model.tie_embeddings=false"]),
                   ("tied", ["model.tie_embeddings=true"])],
    "attention": [("gqa", ["model.attention=gqa"]),
                  ("mla (DeepSeek-V3)", ["model.attention=mla", "model.q_lora_rank=24",
                                         "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
                                         "model.qk_rope_head_dim=8", "model.v_head_dim=16"])],
    "qk_norm": [("no q/k norm", ["model.qk_norm=none"]),
                ("per-head q/k norm (Qwen3)", ["model.qk_norm=head"]),
                ("whole-projection q/k norm (OLMoE)", ["model.qk_norm=full"])],
    "attention_bias": [("no biases", ["model.qkv_bias=false", "model.out_bias=false"]),
                       ("q/k/v and output biases (Qwen2)",
                        ["model.qkv_bias=true", "model.out_bias=true"])],
    "head_dim": [("dim / heads", ["model.head_dim=null"]),
                 ("head_dim 16 != dim / heads", ["model.head_dim=16"])],
    "clip_qkv": [("no clip", ["model.clip_qkv=null"]),
                 ("clip_qkv 2 (OLMoE)", ["model.clip_qkv=2.0"])],
    "partial_rotary": [("whole heads rotated", ["model.partial_rotary_factor=1.0"]),
                       ("half of each head rotated (GLM-4.5, MiniMax-M2)",
                        ["model.partial_rotary_factor=0.5"])],
    "rope_style": [("interleaved pairs", ["model.rope_style=interleaved"]),
                   ("rotate-half (HF)", ["model.rope_style=half"])],
    "rope_scaling": [("no scaling", ["model.rope_scaling=none"]),
                     ("yarn, untruncated (gpt-oss)",
                      ["model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
                       "model.rope_original_max_seq_len=16", "model.rope_yarn_mscale=1.0",
                       "model.rope_yarn_mscale_all_dim=1.0", "model.rope_yarn_truncate=false"]),
                     ("llama3", ["model.rope_scaling=llama3", "model.rope_scaling_factor=8.0",
                                 "model.rope_original_max_seq_len=16"])],
    "attention_sinks": [("no sinks", ["model.attention_sinks=false"]),
                        ("attention sinks (gpt-oss)", ["model.attention_sinks=true"])],
    "mtp": [("no multi-token prediction", ["model.mtp_depth=0"]),
            ("multi-token prediction, depth 1 (DeepSeek-V3, GLM-4.5)",
             ["model.mtp_depth=1", "model.mtp_loss_weight=0.3"])],
    "attention_span": [("full causal", ["model.sliding_window=null",
                                        "model.sliding_window_layers=null"]),
                       ("sliding window 5 on layers 0 and 2 (gpt-oss)",
                        ["model.sliding_window=5", "model.sliding_window_layers=[0,2]"])],
    "documents": [("one causal stream", ["model.document_mask=false",
                                         "model.document_positions=false"]),
                  # positions running on: tests/train/test_document_loss.py, tests/model/
                  ("document mask, positions restart per document",
                   ["model.document_mask=true", "model.document_positions=true",
                    f"data.dataset={SHORT_DOCS}"])],
    # MoE layers
    "moe_every": [("every layer", ["moe.every_n_layers=1"]),
                  ("every 2nd layer", ["moe.every_n_layers=2"])],
    "dense_layers": [("no dense-first layers", ["moe.dense_layers=[]"]),
                     ("first layer dense", ["moe.dense_layers=[0]"])],
    "expert_ffn": [("plain SwiGLU experts", ["moe.router_bias=false", "moe.expert_ffn_bias=false",
                                             "moe.expert_activation=swiglu"]),
                   ("router and expert biases, clamped SwiGLU (gpt-oss)",
                    ["moe.router_bias=true", "moe.expert_ffn_bias=true",
                     "moe.expert_activation=clamped_swiglu", "moe.swiglu_alpha=1.702",
                     "moe.swiglu_limit=0.5"])],
    "shared_experts": [("1 shared", ["moe.num_shared_experts=1"]),
                       ("no shared", ["moe.num_shared_experts=0"])],
    "shared_expert_gate": [("ungated", ["moe.shared_expert_gate=false"]),
                           ("sigmoid-gated shared (Qwen2-MoE)", ["moe.shared_expert_gate=true"])],
    # routing
    "score_func": [("softmax", ["moe.score_func=softmax"]),
                   ("sigmoid", ["moe.score_func=sigmoid"])],
    "renormalize": [("renorm", ["moe.renormalize=true"]),
                    ("no renorm", ["moe.renormalize=false"])],
    "group_routing": [("plain top-k", ["moe.n_groups=1", "moe.routed_scaling_factor=1.0",
                                       "moe.group_score=top2"]),
                      ("groups 2 top-1 group, scaling 2.5 (DeepSeek-V3)",
                       ["moe.n_groups=2", "moe.topk_groups=1", "moe.group_score=top2",
                        "moe.routed_scaling_factor=2.5"]),
                      ("groups 2 scored by their best, top-1 group, scaling 2 (DeepSeek-V2)",
                       ["moe.n_groups=2", "moe.topk_groups=1", "moe.group_score=max",
                        "moe.routed_scaling_factor=2.0"])],
    "jitter": [("no jitter", ["moe.jitter_eps=0.0"]), ("jitter 0.1", ["moe.jitter_eps=0.1"])],
    # capacity
    "capacity": [("capacity 1", ["moe.capacity_factor=1.0"]),
                 ("dropless", ["moe.capacity_factor=null"])],
    "drop_policy": [("drop by score", ["moe.drop_policy=probs"]),
                    ("drop by position", ["moe.drop_policy=position"])],
    "pad_to_capacity": [("unpadded", ["moe.pad_to_capacity=false"]),
                        ("padded to capacity", ["moe.pad_to_capacity=true"])],
    "token_groups": [("token groups of 2", ["moe.token_group_seqs=2"]),
                     ("whole micro-batch", ["moe.token_group_seqs=null"])],
    # balancing
    "aux_loss": [("switch aux", ["moe.aux_loss_coef=0.01"]),
                 ("no switch aux", ["moe.aux_loss_coef=0.0"])],
    "seq_aux_loss": [("seq aux", ["moe.seq_aux_loss_coef=0.001"]),
                     ("no seq aux", ["moe.seq_aux_loss_coef=0.0"])],
    "z_loss": [("z-loss", ["moe.z_loss_coef=0.001"]), ("no z-loss", ["moe.z_loss_coef=0.0"])],
    "global_aux_loss": [("no global aux", ["moe.global_aux_loss_coef=0.0"]),
                        ("global-batch aux 0.05", ["moe.global_aux_loss_coef=0.05"])],
    "force_balance": [("router's choice",
                       ["moe.force_load_balancing=false", "train.benchmark=false"]),
                      ("forced balanced routing (benchmark mode)",
                       ["moe.force_load_balancing=true", "train.benchmark=true"])],
    "routing_replay": [("router's routing", ["train.routing_replay=null"]),
                       ("replayed routing (train.routing_replay)",
                        [f"train.routing_replay={REPLAY}"])],
    "expert_bias": [("bias rate 0.01", ["moe.expert_bias_rate=0.01", "moe.route_with_bias=false"]),
                    ("no bias", ["moe.expert_bias_rate=0.0", "moe.route_with_bias=false"]),
                    ("score-correction bias, frozen (DeepSeek-V3 inference)",
                     ["moe.expert_bias_rate=0.0", "moe.route_with_bias=true"]),
                    # the bias set from the step's histogram of required biases, summed over
                    # every rank (group-limited routing: refused by validation)
                    ("quantile balancing, ema 0.5",
                     ["moe.expert_bias_rate=0.0", "moe.route_with_bias=false",
                      "moe.quantile_balancing=true", "moe.quantile_balancing_ema=0.5"])],
    # training
    # 8 sequences a step: 2 micro-batches of 4 in one process (the cheap baseline), or 4 of 2.
    "accumulation": [("micro-batches of 4", ["train.micro_batch_size=4"]),
                     ("micro-batches of 2", ["train.micro_batch_size=2"])],
    # precision: FP8 emulated on the CPU (the GPU's scales and roundings), bf16 moments
    # (train.fp8_experts=false: tests/parallel/test_fp8_layouts.py)
    "fp8": [("no FP8", ["train.fp8=none"]),
            ("FP8 tensorwise", ["train.fp8=tensorwise"]),
            ("FP8 rowwise", ["train.fp8=rowwise"])],
    "moments": [("fp32 moments", ["optim.moments_dtype=fp32"]),
                ("bf16 moments", ["optim.moments_dtype=bf16"])],
    # the optimizer: Muon with Newton-Schulz in fp32, each split matrix orthogonalized by one
    # owner (the default) or by every holder (optim.muon_distributed); in bf16 the iteration
    # amplifies a reordered sum's rounding flip: that path is proven on the optimizer alone,
    # with the same gradients under every layout, in tests/parallel/test_muon_layouts.py
    "optimizer": [("AdamW", ["optim.name=adamw"]),
                  ("Muon", ["optim.name=muon", "optim.muon_ns_dtype=fp32"]),
                  ("Muon, every holder gathers", ["optim.name=muon", "optim.muon_ns_dtype=fp32",
                                                  "optim.muon_distributed=gather"])],
    # QK-clip at a threshold the cells' logits pass (each layer's largest: 0.04 to 0.08 with
    # GQA, 0.03 to 0.04 with MLA in the first steps): heads rescaled, some left alone
    # (refused with q/k norms and clip_qkv)
    "qk_clip": [("no QK-clip", ["optim.qk_clip=null"]),
                ("QK-clip, tau 0.03 (Kimi K2)", ["optim.qk_clip=0.03"])],
    "activation_checkpointing": [("no AC", ["parallel.activation_checkpointing=none"]),
                                 ("selective AC", ["parallel.activation_checkpointing=selective"]),
                                 ("full AC", ["parallel.activation_checkpointing=full"])],
}  # fmt: skip

FORBIDDEN: list[tuple[dict[str, str], str]] = [
    (
        {"shared_expert_gate": "sigmoid-gated shared (Qwen2-MoE)", "shared_experts": "no shared"},
        "moe.shared_expert_gate needs moe.num_shared_experts > 0",
    ),
    (
        {
            "documents": "document mask, positions restart per document",
            "routing_replay": "replayed routing (train.routing_replay)",
        },
        "the replay files record the embedded corpus's batches; the document rows train on "
        "short documents (train.routing_replay checks the input ids)",
    ),
]
"""(factor -> value label, reason): value combinations that validation refuses and that the
design must not ask for. Most refusals need no entry: rows whose values set one key two
ways, or that config validation refuses, are invalid by themselves."""
