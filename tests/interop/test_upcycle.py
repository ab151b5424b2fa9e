"""Sparse upcycling (``model.upcycle_from``): dense Llama / Mistral / Qwen3 checkpoints become
MoE models whose experts are copies of the dense FFN.

With whole copies and renormalised top-k weights, every token's MoE output is the dense
FFN's whatever the (random, non-trivial) router picks: the upcycled model's logits at step 0
equal the dense transformers model's. Fine-grained parts, router init and copy noise are
checked on the weights themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_zoo import DENSE, VOCAB, save_hf, save_tokenizer
from multirank import micro_config

from moetrain.interop import HFCheckpointError
from moetrain.model.moe import Router
from moetrain.train.trainer import Trainer

LOGIT_ATOL = 1e-5
UPCYCLE = ["moe.num_experts=4", "moe.top_k=2", "moe.renormalize=true", "moe.num_shared_experts=0",
           "moe.capacity_factor=null", "moe.every_n_layers=1"]  # fmt: skip


def _trainer(hf_dir: Path, out: Path, *extra: str) -> Trainer:
    return Trainer(micro_config(out, f"model.upcycle_from={hf_dir}", *UPCYCLE, *extra))


@pytest.mark.parametrize("model_type", list(DENSE))
def test_upcycled_model_starts_as_the_dense_model(model_type: str, tmp_path: Path) -> None:
    dense = save_hf(model_type, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    trainer = _trainer(tmp_path / "hf", tmp_path / "run", "model.upcycle_router_std=0.5")
    model = trainer.engine.parts[0].eval()
    assert len(model.moe_layers()) == dense.config.num_hidden_layers
    ids = []
    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda mod, i, o: ids.append(o.ids_TK))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (model(tokens) - dense(tokens).logits).abs().max().item()
    assert err <= LOGIT_ATOL, f"{model_type}: max abs logit error {err:.2e}"
    # The router is not trivial: tokens are spread over different expert pairs.
    assert len({tuple(r) for r in ids[0].sort(-1).values.tolist()}) > 2
    trainer.close()


def test_fine_grained_parts_router_and_noise(tmp_path: Path) -> None:
    dense = save_hf("llama", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    trainer = _trainer(tmp_path / "hf", tmp_path / "run", "model.upcycle_granularity=2",
                       "model.upcycle_noise=0.01", "model.upcycle_router_std=0.0")  # fmt: skip
    assert trainer.cfg.moe.expert_ffn_dim == dense.config.intermediate_size // 2
    layer = trainer.engine.parts[0].moe_layers()[0]
    mlp = dense.model.layers[0].mlp
    F = trainer.cfg.moe.expert_ffn_dim
    for e in range(4):
        part = slice((e % 2) * F, (e % 2 + 1) * F)
        for ours, ref, scale in (
            (layer.experts.w1[e], mlp.gate_proj.weight[part].T, 1.0),
            (layer.experts.w2[e], mlp.down_proj.weight[:, part].T, 2.0),
        ):
            rel = (ours / (ref * scale) - 1).detach()
            assert 0.001 < rel.std().item() < 0.02, (e, rel.std().item())  # noisy copies
    assert not torch.equal(layer.experts.w1[0], layer.experts.w1[2])  # noise differs
    assert torch.count_nonzero(layer.router.gate.weight) == 0
    trainer.close()


def test_upcycling_an_moe_checkpoint_is_refused(tmp_path: Path) -> None:
    save_hf("mixtral", tmp_path / "hf")
    with pytest.raises(HFCheckpointError, match="already an MoE model; start from it with "
                       "model.init_from"):  # fmt: skip
        _trainer(tmp_path / "hf", tmp_path / "run")
