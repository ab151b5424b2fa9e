"""Activation checkpointing and the MoE layers' statistics (parallel/activation_checkpoint.py).

A recomputed block runs its MoE layers' forwards again in backward. The statistics object
(``MoEStats``) must count each forward once, and the recompute must route as the forward did
(router jitter is keyed by the layer's sequence counter, which the forward advanced). The
reference is the same two micro-batches without checkpointing, in the same process: equal
statistics, bit for bit, and equal gradients. Each guard is also planted broken and seen
caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.moe import MoELayer
from moetrain.model.moe_stats import MoEStats
from moetrain.model.transformer import build_model
from moetrain.parallel import activation_checkpoint
from moetrain.parallel.activation_checkpoint import apply_ac

V, MB, SEQS, S = 32, 2, 2, 8
GRAD_TOL = {"atol": 1e-6, "rtol": 1e-5}
"""Gradients: the same ops on the same values (one process, one thread count); a recompute that
routes otherwise moves them by more than 1e-3."""


def _step(mode: str) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(every MoE layer's statistics, every gradient) of two micro-batches, forward and
    backward, with activation checkpointing ``mode``."""
    cfg = ModelConfig(vocab_size=V, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
                      max_seq_len=S)  # fmt: skip
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, every_n_layers=1, kernels="torch",
                    jitter_eps=0.3, capacity_factor=1.0)  # fmt: skip
    model = build_model(cfg, moe, seed=0).train()
    apply_ac(model, mode)
    layers = {m.layer_id: m for m in model.modules() if isinstance(m, MoELayer)}
    for layer in layers.values():
        layer.set_jitter_key(seed=1, step=0, seq_offset=0)
    tokens = torch.randint(0, V, (MB, SEQS, S + 1), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    for mb in tokens:
        logits = model(mb[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / MB).backward()
    stats = {i: layer.pop_stats() for i, layer in layers.items()}
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    return stats, grads


def _check_against_no_checkpointing(mode: str) -> None:
    want_stats, want_grads = _step("none")
    stats, grads = _step(mode)
    assert float(want_stats[0]["calls"]) == MB
    for i, want in want_stats.items():
        for name, value in want.items():
            got = stats[i][name]
            assert torch.equal(got, value), f"layer {i} {name}: {got} != {value}"
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert torch.allclose(grads[name], g, **GRAD_TOL), (
            f"{name}: max error {(grads[name] - g).abs().max():.3g}"
        )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recompute_counts_nothing_twice_and_routes_as_the_forward_did(mode: str) -> None:
    _check_against_no_checkpointing(mode)


def test_a_recompute_whose_statistics_are_kept_is_caught(monkeypatch) -> None:
    """``MoEStats.restore`` forgotten: what the recompute counted is kept. torch stops a
    recompute once it has what backward needs, which here comes before the layer counts its
    statistics (its sequence counter, advanced when it routes, ends where the forward left
    it): the fault shows where the recompute runs to the end, as it does with early stopping
    off (``set_checkpoint_early_stop``), and the statistics differ."""
    monkeypatch.setattr(MoEStats, "restore", lambda self, saved: None)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        with pytest.raises(AssertionError, match=r"layer \d \w+: "):
            _check_against_no_checkpointing("full")


def test_a_recompute_from_the_advanced_sequence_counter_is_caught(monkeypatch) -> None:
    """The recompute not restarted at the forward's sequence counter: it draws other router
    jitter factors and routes other tokens (torch may already refuse the recompute's other
    shapes)."""
    enter = activation_checkpoint._KeepMoEStats.__enter__

    def keep_rows(self) -> None:
        rows = [m.stats.rows.clone() for m in self.layers]
        enter(self)
        for m, r in zip(self.layers, rows, strict=True):
            m.stats.rows.copy_(r)

    monkeypatch.setattr(activation_checkpoint._KeepMoEStats, "__enter__", keep_rows)
    with pytest.raises((AssertionError, CheckpointError)):
        _check_against_no_checkpointing("full")
