"""Sparse upcycling: an MoE whose experts start as copies of a dense model's FFN.

Attention, norms and embeddings are the dense checkpoint's; in every MoE layer (the moe
section decides which, how many experts and the routing) expert e is part ``e % g`` of the
dense SwiGLU, split along its hidden units into g = ``model.upcycle_granularity`` parts of
``ffn_dim / g`` (g = 1: whole copies). Dense layers stay the dense FFN.

Why it starts where the dense model is: with whole copies (g = 1) and renormalised top-k
weights, a token's output is sum_k w_k FFN(x) with sum_k w_k = 1, i.e. FFN(x), whatever the
router picks. Fine-grained parts (g > 1) have their down-projection scaled by g, so that a
token spreading its weight evenly over one copy of each part sees the dense FFN's scale
("weight scaling" of fine-grained upcycling); no routing reproduces the dense model exactly.

Options (the model section): ``upcycle_router_std`` (0: a zero router, every expert scored
alike), ``upcycle_noise`` (multiplicative noise on each copy, so that copies can diverge;
the values depend on the seed, layer and expert only, so every rank draws the same).
"""

from __future__ import annotations

import logging

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.errors import HFCheckpointError
from moetrain.interop.families import Family
from moetrain.interop.sources import ExpertCopies, Generated, Rows, Source
from moetrain.model.transformer import is_moe_layer


def check_upcycle(family: Family, m: ModelConfig, e: MoEConfig, key: str) -> None:
    if family.moe:
        raise HFCheckpointError(f"{key}: {family.model_type} is already an MoE model; start "
                                "from it with model.init_from")  # fmt: skip
    g = m.upcycle_granularity
    if m.ffn_dim % g:
        raise HFCheckpointError(f"model.upcycle_granularity: {g} does not divide the dense "
                                f"FFN width {m.ffn_dim}")  # fmt: skip
    if e.num_experts % g:
        raise HFCheckpointError(f"model.upcycle_granularity: {g} does not divide "
                                f"moe.num_experts={e.num_experts}")  # fmt: skip
    if e.num_shared_experts:
        raise HFCheckpointError(
            f"{key}: moe.num_shared_experts must be 0 when upcycling (every routed expert is "
            "already a copy of the dense FFN; a shared one would add it twice)"
        )


log = logging.getLogger("moetrain")


def warn_upcycle_routing(e: MoEConfig) -> None:
    """Routing that keeps the upcycled model from starting where the dense one is."""
    every_expert = e.score_func == "softmax" and e.top_k == e.num_experts  # weights sum to 1
    if not e.renormalize and not every_expert:
        log.warning(
            "model.upcycle_from with moe.renormalize=%s (top_k=%d): a token's expert weights do "
            "not sum to one, so the upcycled model does not start as the dense model (set "
            "moe.renormalize=true to start there)", e.renormalize, e.top_k,
        )  # fmt: skip
    if e.routed_scaling_factor != 1.0:
        log.warning(
            "model.upcycle_from with moe.routed_scaling_factor=%g: the experts' output is "
            "scaled, so the upcycled model does not start as the dense model",
            e.routed_scaling_factor,
        )


def upcycle_sources(family: Family, m: ModelConfig, e: MoEConfig, seed: int) -> dict[str, Source]:
    """moetrain name -> source of the upcycled model."""
    sources = family.sources(m, MoEConfig(num_experts=0))
    g, noise = m.upcycle_granularity, m.upcycle_noise
    E, D, Fe = e.num_experts, m.dim, e.expert_ffn_dim
    for i in range(m.n_layers):
        if not is_moe_layer(i, e):
            continue
        q = f"layers.{i}.ffn"
        dense = [sources.pop(f"{q}.{w}.weight") for w in ("w1", "w3", "w2")]
        gate, up, down = (src.key for src in dense if isinstance(src, Rows))
        base = (seed * 1009 + i) * 3
        sources[f"{q}.router.gate.weight"] = Generated((E, D), m.upcycle_router_std, base)
        sources[f"{q}.experts.w1"] = ExpertCopies(gate, (E, D, Fe), g, 0, 1.0, noise, base)
        sources[f"{q}.experts.w3"] = ExpertCopies(up, (E, D, Fe), g, 0, 1.0, noise, base + 1)
        sources[f"{q}.experts.w2"] = ExpertCopies(down, (E, Fe, D), g, 1, float(g), noise,
                                                  base + 2)  # fmt: skip
    return sources
