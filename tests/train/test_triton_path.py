"""The MoE layer trains with the Triton kernels (interpreted on CPU, compiled on GPU) and
gives the same outputs, gradients, losses and parameters as the pure-torch path, within the
one kernel tolerance table (``tests/kernels/kernel_testing.py``: the Triton kernels
accumulate in another order than torch._grouped_mm)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moetrain.config import load_config
from moetrain.model import build_model
from moetrain.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_testing import assert_close  # noqa: E402  (the one tolerance table)

TINY = [
    "model.vocab_size=128",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_dim=128",
    "model.max_seq_len=32",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.expert_ffn_dim=64",
    "moe.num_shared_experts=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "data.seq_len=16",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "moe_opts",
    [
        ["moe.capacity_factor=null", "moe.score_func=softmax"],
        ["moe.capacity_factor=1.0", "moe.score_func=sigmoid", "moe.pad_to_capacity=true"],
        # gpt-oss's experts: biases and the clamped SwiGLU between the Triton GEMMs, with
        # dropped rows past the last expert (the zero bias row).
        ["moe.capacity_factor=1.0", "moe.router_bias=true", "moe.expert_ffn_bias=true",
         "moe.expert_activation=clamped_swiglu", "moe.swiglu_limit=0.5"],
    ],
    ids=["dropless-softmax", "padded-sigmoid", "gpt-oss-experts"],
)  # fmt: skip
def test_layer_forward_and_gradients_match_torch_path(moe_opts: list[str]) -> None:
    grads = {}
    outs = {}
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for backend in ("torch", "triton"):
        cfg = load_config(None, [*TINY, *moe_opts, f"moe.kernels={backend}"])
        model = build_model(cfg.model, cfg.moe, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # biases away from their zero init, the same on both paths
            for name, p in model.named_parameters():
                if name.endswith(("experts.b1", "experts.b3", "experts.b2", "gate.bias")):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        outs[backend] = logits.detach()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_close(outs["triton"], outs["torch"], "logits")
    for name, g in grads["torch"].items():
        assert_close(grads["triton"][name], g, f"grad {name}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_losses_match_torch_path(tmp_path: Path) -> None:
    losses, params = {}, {}
    for backend in ("torch", "triton"):
        cfg = load_config(
            None,
            [
                *[o for o in TINY if not o.startswith("model.vocab_size")],
                "moe.capacity_factor=1.25",
                "train.steps=3",
                "train.eval_every=0",
                "train.eval_batches=1",
                "log.progress_bar=false",
                "log.tensorboard=false",
                f"moe.kernels={backend}",
                f"train.output_dir={tmp_path / backend}",
            ],
        )
        trainer = Trainer(cfg)
        losses[backend] = torch.tensor([trainer.train_step().loss for _ in range(3)])
        params[backend] = trainer.full_model_state_dict()
        trainer.close()
    assert_close(losses["triton"], losses["torch"], "losses of 3 steps")
    assert sorted(params["triton"]) == sorted(params["torch"])
    for name, want in params["torch"].items():
        assert_close(params["triton"][name], want, f"param {name} after 3 steps")
