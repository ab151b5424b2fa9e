"""export-hf of checkpoints that moetrain trained itself, saved under a parallel layout.

Three native architectures (moetrain's own interleaved RoPE pairing, which export converts
to transformers' rotate-half rows) train one step on 2 ranks and save; the exported
directory loads in transformers as the family that expresses it, with the logits of the
checkpoint's model (read back in one process, routed dropless as transformers routes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from multirank import micro_config, run_ranks

from moetrain.interop.checkpoints import checkpoint_info, load_model
from moetrain.interop.convert import export_hf

LOGIT_ATOL = 1e-5
NATIVE = ["moe.num_shared_experts=0", "moe.expert_bias_rate=0.0", "train.steps=1",
          "train.checkpoint_every=1"]  # fmt: skip
CASES: dict[str, tuple[str, list[str]]] = {
    "mixtral": ("tp=2 + SP", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "qwen3_moe": ("ep=2 + zero3", ["model.qk_norm=head", "model.head_dim=32",
                                   "moe.dense_layers=[1]", "parallel.ep=2",
                                   "parallel.zero_stage=3"]),
    "olmoe": ("pp=2", ["model.qk_norm=full", "moe.renormalize=false", "parallel.pp=2",
                       "parallel.pp_schedule=1f1b"]),
}  # fmt: skip


def _worker(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> None:
    from moetrain.train.trainer import Trainer

    for out, overrides in runs:
        Trainer(micro_config(out, *NATIVE, *overrides)).fit()


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_checkpoints_saved_under_layouts(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    runs = [(str(tmp_path / family), overrides) for family, (_, overrides) in CASES.items()]
    run_ranks(_worker, 2, runs, timeout=550)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(2))
    for family, (layout, _) in CASES.items():
        export_hf(tmp_path / family, tmp_path / f"{family}-hf")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf").eval()
        assert hf.config.model_type == family, (family, hf.config.model_type)
        info = checkpoint_info(tmp_path / family)
        assert info.model.rope_style == "interleaved" and info.step == 1
        info.moe.capacity_factor = None  # transformers routes dropless
        ours = load_model(info).eval()
        with torch.no_grad():
            err = (hf(tokens).logits - ours(tokens)).abs().max().item()
        print(f"{family} saved under {layout}: max abs logit error {err:.2e}")
        assert err <= LOGIT_ATOL, (family, err)


def test_a_family_that_cannot_express_the_model_is_refused(tmp_path: Path) -> None:
    """``--family`` naming a family that cannot express the checkpoint says what keeps it out
    (without it, export writes moetrain's own model: test_self_contained.py)."""
    from moetrain.interop import HFCheckpointError
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        Trainer(micro_config(out, "train.steps=1", "train.checkpoint_every=1")).fit()
        expected = r"export-hf --family mixtral: the checkpoint has an expert selection bias, "
        with pytest.raises(HFCheckpointError, match=expected):
            export_hf(out, tmp_path / "hf", family="mixtral")
        assert not (tmp_path / "hf").exists()
