"""``model.init_from``: a 2-rank run starts from a transformers checkpoint and its first-step
loss is transformers' loss on the same batch; every rank read only the slices it holds.

One spawned job runs a family per layout: Mixtral and DeepSeek-V3 under tp=2 + sequence
parallelism, Qwen2-MoE under tp=2, OLMoE under pp=2, Qwen3-MoE under ep=2 with ZeRO-3; GLM-4.5
under tp=2 + sequence parallelism, MiniMax-M2 under pp=2, DeepSeek-V2 under ep=2 with ZeRO-3,
gpt-oss under tp=2 + sequence parallelism (its sinks read as each rank's heads).
Routing is dropless (transformers has no capacity), so the first forward is the model's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_zoo import save_hf, save_tokenizer
from multirank import VALUE_TOL, micro_config, run_ranks

LAYOUTS: dict[str, list[str]] = {
    "mixtral": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "deepseek_v3": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "qwen2_moe": ["parallel.tp=2"],
    "olmoe": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "qwen3_moe": ["parallel.ep=2", "parallel.zero_stage=3"],
    "glm4_moe": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "minimax_m2": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "deepseek_v2": ["parallel.ep=2", "parallel.zero_stage=3"],
    "gpt_oss": ["parallel.tp=2", "parallel.sequence_parallel=true"],
}


def _worker(rank: int, world_size: int, runs: list[tuple[str, str, list[str]]]) -> list[dict]:
    from moetrain.interop.hf_files import HFDirectory
    from moetrain.train.trainer import Trainer

    reads: list[tuple[str, tuple | None]] = []
    original = HFDirectory.read

    def recording_read(self, name, index=None):
        out = original(self, name, index)
        reads.append((name, tuple(out.shape)))
        return out

    HFDirectory.read = recording_read
    results = []
    for _family, hf_dir, layout in runs:
        reads.clear()
        with tempfile.TemporaryDirectory() as out:
            cfg = micro_config(out, f"model.init_from={hf_dir}", "moe.capacity_factor=null",
                               "train.steps=2", *layout)  # fmt: skip
            trainer = Trainer(cfg)
            state = trainer.train_data.state_dict()
            batches = trainer.train_data.next_step()
            trainer.train_data.load_state_dict(state)
            first = trainer.train_step()
            second = trainer.train_step()
            coords = trainer.dims.coords(rank)
            results.append({
                "loss": [first.loss, second.loss],
                "dp_rank": coords["dp_replicate"] * trainer.dims.dp_shard + coords["dp_shard"],
                "batches": batches,
                "reads": list(reads),
                "tokenizer": trainer.cfg.data.tokenizer,
                "dim": trainer.cfg.model.dim,
            })  # fmt: skip
            trainer.close()
    return results


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_init_from_trains_from_transformers_loss(tmp_path: Path) -> None:
    models, runs = {}, []
    for family, layout in LAYOUTS.items():
        hf_dir = tmp_path / family
        models[family] = save_hf(family, hf_dir)
        save_tokenizer(hf_dir)
        runs.append((family, str(hf_dir), layout))
    per_rank = run_ranks(_worker, 2, runs, timeout=850)
    for i, (family, hf_dir, layout) in enumerate(runs):
        ranks = [r[i] for r in per_rank]
        hf = models[family]
        assert ranks[0]["tokenizer"] == hf_dir and ranks[0]["dim"] == hf.config.hidden_size
        # transformers' loss on the step's global batch (each dp rank's micro-batches once).
        by_dp = {r["dp_rank"]: r["batches"] for r in ranks}
        inputs = torch.cat([b["input_ids"] for dp in sorted(by_dp) for b in by_dp[dp]])
        labels = torch.cat([b["labels"] for dp in sorted(by_dp) for b in by_dp[dp]])
        with torch.no_grad():
            logits = hf(inputs).logits
        ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
        got = ranks[0]["loss"][0]
        print(f"{family} ({' '.join(layout)}): first-step loss {got:.6f}, transformers {ref:.6f}")
        assert abs(got - ref) <= VALUE_TOL["atol"] + VALUE_TOL["rtol"] * abs(ref), family
        assert ranks[0]["loss"][1] != got  # it trained
        _check_slices(family, layout, ranks, hf.config)


def _check_slices(family: str, layout: list[str], ranks: list[dict], cfg) -> None:
    """What each rank read: halves of the split tensors under tp, its own stage's layers
    under pp, its own experts' matrices under ep; never the whole model."""
    for rank, r in enumerate(ranks):
        names = {name for name, _ in r["reads"]}
        shapes = dict(r["reads"])
        if "parallel.tp=2" in layout:
            q = "model.layers.0.self_attn.q_b_proj.weight" if family == "deepseek_v3" else (
                "model.layers.0.self_attn.q_proj.weight")  # fmt: skip
            full = cfg.num_attention_heads * (
                cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                if family == "deepseek_v3"
                else getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            )
            assert shapes[q][0] == full // 2, (family, rank, shapes[q])
        if "parallel.pp=2" in layout:
            mine = {n for n in names if n.startswith("model.layers.")}
            layer = str(rank)  # two layers, one per stage
            assert mine and all(n.split(".")[2] == layer for n in mine), (family, rank)
            assert ("lm_head.weight" in names) == (rank == 1)
            assert ("model.embed_tokens.weight" in names) == (rank == 0)
        if "parallel.ep=2" in layout:
            experts = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
            E = cfg.num_experts
            assert experts == set(range(rank * E // 2, (rank + 1) * E // 2)), (rank, experts)
