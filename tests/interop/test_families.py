"""moetrain reproduces the forward pass of each transformers family exactly.

For every family a tiny random model (tests/interop/hf_zoo.py) is saved with
``save_pretrained``, read back with ``moetrain.interop.from_hf`` and both run the same
tokens in fp32: the logits agree within LOGIT_ATOL and every MoE layer picks the same
top-k experts for every token (as sets: transformers' DeepSeek router returns them
unsorted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_zoo import CONFIGS, DENSE, VOCAB, routers, save_hf

from moetrain.interop import from_hf
from moetrain.model.moe import Router

LOGIT_ATOL = 1e-5
"""fp32, max abs logit error against transformers (logits are O(1) here)."""


def tokens(seed: int = 3, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run_both(hf_model, ours, tokens_BS: torch.Tensor):
    """Logits and per-layer expert ids of both models on the same tokens."""
    hf_ids: list[torch.Tensor] = []
    our_ids: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda m, i, o: hf_ids.append(o[2])) for r in routers(hf_model)
    ]
    hooks += [
        m.register_forward_hook(lambda m, i, o: our_ids.append(o.ids_TK))
        for m in ours.modules()
        if isinstance(m, Router)
    ]
    try:
        with torch.no_grad():
            hf_logits = hf_model(tokens_BS).logits
            our_logits = ours(tokens_BS)
    finally:
        for h in hooks:
            h.remove()
    return hf_logits, our_logits, hf_ids, our_ids


@pytest.mark.thread_counts
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_forward_matches_transformers(model_type: str, tmp_path: Path) -> None:
    hf_model = save_hf(model_type, tmp_path)
    ours = from_hf(tmp_path)
    hf_logits, our_logits, hf_ids, our_ids = run_both(hf_model, ours, tokens())
    err = (hf_logits - our_logits).abs().max().item()
    print(f"{model_type}: max abs logit error {err:.2e}")
    assert err <= LOGIT_ATOL, f"{model_type}: max abs logit error {err:.2e}"
    assert len(hf_ids) == len(our_ids) >= 2
    for layer, (a, b) in enumerate(zip(hf_ids, our_ids, strict=True)):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values), f"layer {layer}: expert ids"
    # Non-trivial routing: tokens do not all go to the same experts.
    assert len({tuple(row) for row in our_ids[0].sort(-1).values.tolist()}) > 3


@pytest.mark.parametrize("model_type", list(DENSE))
def test_dense_forward_matches_transformers(model_type: str, tmp_path: Path) -> None:
    """The dense sources of sparse upcycling (llama3 RoPE scaling, per-head q/k norms,
    tied embeddings) read back exactly too."""
    hf_model = save_hf(model_type, tmp_path)
    ours = from_hf(tmp_path)
    hf_logits, our_logits, _, _ = run_both(hf_model, ours, tokens())
    err = (hf_logits - our_logits).abs().max().item()
    assert err <= LOGIT_ATOL, f"{model_type}: max abs logit error {err:.2e}"


def test_routing_options_matter(tmp_path: Path) -> None:
    """The DeepSeek-V3 options are not decoration: without the score-correction bias, the
    group limit or the scaling factor, moetrain's forward leaves transformers'."""
    hf_model = save_hf("deepseek_v3", tmp_path)
    for override in ({"route_with_bias": False}, {"n_groups": 1, "topk_groups": 1},
                     {"routed_scaling_factor": 1.0}):  # fmt: skip
        ours = from_hf(tmp_path)
        for layer in ours.moe_layers().values():
            for k, v in override.items():
                setattr(layer.cfg, k, v)
        hf_logits, our_logits, _, _ = run_both(hf_model, ours, tokens())
        assert (hf_logits - our_logits).abs().max().item() > 1e-3, override


def test_deepseek_rope_interleave_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 with ``rope_interleave: false`` reads as the rotate-half RoPE pairing."""
    import hf_zoo

    cls_name, kwargs = hf_zoo.CONFIGS["deepseek_v3"]
    monkeypatch.setitem(
        hf_zoo.CONFIGS, "deepseek_v3", (cls_name, {**kwargs, "rope_interleave": False})
    )
    hf_model = save_hf("deepseek_v3", tmp_path)
    ours = from_hf(tmp_path)
    assert ours.cfg.rope_style == "half"
    hf_logits, our_logits, _, _ = run_both(hf_model, ours, tokens())
    assert (hf_logits - our_logits).abs().max().item() <= LOGIT_ATOL


def test_gpt_oss_options_matter(tmp_path: Path) -> None:
    """Each gpt-oss option is seen in the logits (tests/interop/hf_zoo.py draws the sinks and
    biases away from zero, and sets a clamp limit the tiny model reaches): without the sinks,
    the sliding window, the router bias, the expert biases, the clamped activation, its
    alpha or its limit, or with YaRN's range truncated, moetrain's forward leaves
    transformers'; with all of them it matches (``test_forward_matches_transformers``)."""
    import dataclasses

    from moetrain.model.rope import rope_tables

    hf_model = save_hf("gpt_oss", tmp_path)

    def no_sinks(model):
        for block in model.layers.values():
            block.attention.sinks = None

    def moe_cfg(**changes):
        def apply(model):
            for layer in model.moe_layers().values():
                for k, v in changes.items():
                    setattr(layer.experts, {"expert_activation": "activation",
                                            "swiglu_alpha": "alpha",
                                            "swiglu_limit": "limit"}[k], v)  # fmt: skip

        return apply

    def zero(suffixes):
        def apply(model):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(suffixes):
                        p.zero_()

        return apply

    def truncated(model):
        model.cfg = dataclasses.replace(model.cfg, rope_yarn_truncate=True)
        cos, sin = rope_tables(model.cfg)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)

    def full_attention(model):
        model.cfg = dataclasses.replace(model.cfg, sliding_window=None,
                                        sliding_window_layers=None)  # fmt: skip

    changes = {
        "no sinks": no_sinks,
        "no sliding window": full_attention,
        "no router bias": zero(("router.gate.bias",)),
        "no expert biases": zero(("experts.b1", "experts.b3", "experts.b2")),
        "plain SwiGLU": moe_cfg(expert_activation="swiglu"),
        "alpha 1.702": moe_cfg(swiglu_alpha=1.702),
        "limit 7": moe_cfg(swiglu_limit=7.0),
        "YaRN truncated": truncated,
    }
    for what, change in changes.items():
        ours = from_hf(tmp_path)
        change(ours)
        hf_logits, our_logits, _, _ = run_both(hf_model, ours, tokens())
        # Well outside the agreement tolerance (YaRN's ends move low frequencies only, which
        # these short sequences barely turn: 5e-4).
        assert (hf_logits - our_logits).abs().max().item() > 10 * LOGIT_ATOL, what
