"""Layout validation: every invalid layout fails before any process group exists, with an
error naming the keys and the numbers; the derived degrees and the rank order."""

from __future__ import annotations

import pytest

from moetrain.config import ConfigError, load_config
from moetrain.parallel.dims import ParallelDims

BASE = [
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.vocab_size=512",
    "model.tie_embeddings=false",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.token_group_seqs=2",
    "data.seq_len=32",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
]


def dims_for(world: int, *overrides: str) -> ParallelDims:
    cfg = load_config(None, [*BASE, *overrides])
    return ParallelDims.from_config(cfg.parallel, world).validate(cfg)


INVALID = [
    # (world size, overrides, text the message must contain)
    (
        8,
        ["parallel.tp=3"],
        "parallel.pp * parallel.dp_replicate * parallel.tp = 1 * 1 * 3 = 3 "
        "does not divide the world size 8",
    ),
    (
        8,
        ["parallel.dp_shard=3", "parallel.tp=2"],
        "parallel.pp * parallel.dp_replicate * parallel.dp_shard * parallel.tp = 1 * 1 * 3 * 2 = "
        "6, but the world size is 8",
    ),
    (8, ["parallel.tp=8"], "model.n_heads: 4 is not divisible by parallel.tp=8"),
    (4, ["parallel.tp=4"], "model.n_kv_heads: 2 kv heads are not divisible by parallel.tp=4"),
    (
        2,
        ["parallel.tp=2", "model.ffn_dim=129"],
        "model.ffn_dim: 129 is not divisible by parallel.tp=2",
    ),
    (
        2,
        ["parallel.tp=2", "model.vocab_size=513"],
        "model.vocab_size: 513 is not divisible by parallel.tp=2",
    ),
    (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=31"],
        "data.seq_len: 31 is not divisible by parallel.tp=2",
    ),
    (1, ["parallel.sequence_parallel=true"], "parallel.sequence_parallel: needs parallel.tp > 1"),
    (
        4,
        ["parallel.pp=4", "parallel.pp_virtual_stages=2"],
        "model.n_layers: 4 layers do not split into parallel.pp * parallel.pp_virtual_stages = "
        "4 * 2 = 8 equal stages (and 4 layers are too few for 8 stages of at least one layer "
        "between the first and the last)",
    ),
    # uneven pipeline stages (parallel.pp_stage_layers)
    (
        2,
        ["parallel.pp=2", "model.n_layers=5"],
        "model.n_layers: 5 layers do not split into parallel.pp * parallel.pp_virtual_stages = "
        "2 * 1 = 2 equal stages; for uneven stages set parallel.pp_stage_layers to 2 layer "
        "counts summing to 5, e.g. [3, 2]",
    ),
    (
        4,
        ["parallel.pp=4", "parallel.pp_schedule=1f1b", "model.n_layers=6"],
        "e.g. [1, 2, 2, 1]",  # the extra layers between the first and the last stage first
    ),
    (
        4,
        ["parallel.pp=4", "parallel.pp_schedule=1f1b", "model.n_layers=7"],
        "e.g. [2, 2, 2, 1]",  # then on the first (the embedding costs no compute), not the last
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_stage_layers=[3,2]"],
        "parallel.pp_stage_layers: [3, 2] sum to 5 layers, but model.n_layers=4",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_stage_layers=[1,1,2]"],
        "parallel.pp_stage_layers: 3 counts [1, 1, 2], but parallel.pp * parallel."
        "pp_virtual_stages = 2 * 1 = 2 stages: give one layer count per stage",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_virtual_stages=2", "parallel.pp_stage_layers=[2,0,1,1]"],
        "parallel.pp_stage_layers: stages [1] of [2, 0, 1, 1] hold no layer: only the first "
        "stage (the embedding) and the last (the output head) may be empty",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_stage_layers=[5,-1]"],
        "parallel.pp_stage_layers: layer counts must be >= 0, got [5, -1]",
    ),
    (
        1,
        ["parallel.pp_stage_layers=[4]"],
        "parallel.pp_stage_layers: [4] set but parallel.pp=1: without a pipeline every rank "
        "holds every layer; set parallel.pp_stage_layers=null",
    ),
    (
        2,
        ["parallel.pp=2", "model.tie_embeddings=true"],
        "model.tie_embeddings: true cannot span pipeline stages (parallel.pp=2",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_virtual_stages=2"],
        "parallel.pp_virtual_stages: 2 needs an interleaved schedule",
    ),
    (
        4,
        ["parallel.pp=4", "train.micro_batch_size=8"],
        "parallel.pp_microbatches: 2 micro-batches per step is fewer than parallel.pp=4 stages",
    ),
    (
        4,
        ["parallel.pp=2", "train.global_batch_size=12", "train.micro_batch_size=2"],
        "parallel.pp_microbatches: 3 micro-batches per step is not a multiple of parallel.pp=2",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_microbatches=5"],
        "train.global_batch_size: 16 is not divisible by dp * parallel.pp_microbatches = 1 * 5",
    ),
    (
        3,
        ["train.global_batch_size=16"],
        "train.global_batch_size: 16 is not divisible by dp * train.micro_batch_size = 3 * 2 = 6",
    ),
    (
        4,
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "parallel.pp=2",
            "parallel.pp_microbatches=4",
        ],
        "moe.token_group_seqs: 2 does not divide the per-rank micro-batch of 1 sequences",
    ),
    (1, ["parallel.pp_microbatches=4"], "parallel.pp_microbatches: 4 set but parallel.pp=1"),
    (4, ["parallel.ep=3"], "parallel.ep: 3 does not divide moe.num_experts=4"),
    (
        6,
        ["parallel.ep=4", "train.global_batch_size=12"],
        "parallel.ep: 4 does not divide the data-parallel size 6",
    ),
    (4, ["parallel.ep=2", "moe.num_experts=0"], "parallel.ep: 2 needs MoE layers"),
    (
        4,
        ["parallel.ep=2", "parallel.tp=2", "parallel.expert_tp=true", "moe.expert_ffn_dim=33"],
        "moe.expert_ffn_dim: 33 is not divisible by parallel.tp=2",
    ),
    (  # expert TP is the default under tp, ep or not
        2,
        ["parallel.tp=2", "moe.expert_ffn_dim=33"],
        "moe.expert_ffn_dim: 33 is not divisible by parallel.tp=2 (parallel.expert_tp splits",
    ),
    (
        2,
        ["parallel.tp=2", "moe.num_shared_experts=1", "moe.shared_expert_ffn_dim=33"],
        "moe.shared_expert_ffn_dim: the shared experts' width 33 is not divisible by parallel.tp=2",
    ),
    (4, ["parallel.ep=2", "parallel.ep_dispatcher=ring"], "parallel.ep_dispatcher"),
    (
        2,
        ["parallel.pp=2", "parallel.pp_microbatches=16", "moe.token_group_seqs=null"],
        "parallel.pp_microbatches: 16 pipeline micro-batches make micro-batches of 1 sequences "
        "instead of train.micro_batch_size=",
    ),
    # context parallelism
    (
        6,
        ["parallel.cp=4"],
        "parallel.pp * parallel.dp_replicate * parallel.cp * parallel.tp = 1 * 1 * 4 * 1 = 4 "
        "does not divide the world size 6",
    ),
    (
        8,
        ["parallel.cp=2", "parallel.dp_shard=2"],
        "parallel.pp * parallel.dp_replicate * parallel.dp_shard * parallel.cp * parallel.tp = "
        "1 * 1 * 2 * 2 * 1 = 4, but the world size is 8",
    ),
    (
        4,
        ["parallel.cp=4", "data.seq_len=36"],
        "data.seq_len: 36 does not split into 2 * parallel.cp = 8 equal chunks",
    ),
    (
        8,
        [
            "parallel.cp=2",
            "parallel.tp=4",
            "parallel.sequence_parallel=true",
            "data.seq_len=36",
            "model.n_kv_heads=4",
        ],
        "data.seq_len: the 18 positions a cp rank holds (data.seq_len / parallel.cp = 36 / 2) "
        "are not divisible by parallel.tp=4",
    ),
    (
        6,
        ["parallel.cp=2", "parallel.ep=4", "train.global_batch_size=12"],
        "parallel.ep: 4 does not divide the data-parallel x context-parallel size 6 "
        "(parallel.dp_replicate * parallel.dp_shard * parallel.cp)",
    ),
    # the new schedules and the breadth-first / depth-first micro-batches
    (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=zbv"],
        "parallel.pp_virtual_stages: 1, but parallel.pp_schedule='zbv' places exactly 2 stages",
    ),
    (
        4,
        [
            "parallel.pp=2",
            "parallel.pp_schedule=dualpipev",
            "parallel.pp_virtual_stages=2",
            "train.micro_batch_size=4",
        ],
        "parallel.pp_microbatches: 2 micro-batches per step is fewer than the 4 stages "
        "(parallel.pp * parallel.pp_virtual_stages = 2 * 2)",
    ),
    (
        4,
        [
            "parallel.pp=4",
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
            "model.n_layers=8",
            "train.micro_batch_size=8",
        ],
        "parallel.pp_microbatches: 2 micro-batches per step is fewer than parallel.pp=4",
    ),
    (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.depth_first_micro_batches=8"],
        "parallel.pp_microbatches: 1 micro-batches per pass of the schedule (parallel."
        "breadth_first_micro_batches) is fewer than parallel.pp=2",
    ),
    (
        1,
        ["parallel.breadth_first_micro_batches=3"],
        "parallel.breadth_first_micro_batches: 3 does not divide the 8 micro-batches",
    ),
    (
        1,
        ["parallel.breadth_first_micro_batches=2", "parallel.depth_first_micro_batches=2"],
        "parallel.breadth_first_micro_batches: 2 * parallel.depth_first_micro_batches=2 = 4, "
        "but a step has 8 micro-batches",
    ),
    (1, ["parallel.cp=0"], "parallel.cp: must be >= 1, got 0"),
]


@pytest.mark.parametrize(
    ("world", "overrides", "message"), INVALID, ids=[" ".join(o) for _, o, _ in INVALID]
)
def test_invalid_layout_names_keys_and_numbers(
    world: int, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        dims_for(world, *overrides)
    assert message in str(exc.value)


def test_uneven_stages_take_their_layers_in_order_under_every_placement() -> None:
    """Stage s holds the next pp_stage_layers[s] layers; the looped and the V placements put
    the stages on ranks as for equal stages; the first and the last stage may be empty, and
    multi-token-prediction modules join the last stage however many layers it has."""
    from moetrain.parallel.pipeline import (
        stage_ids,
        stage_layers,
        stage_modules,
        suggested_stage_layers,
    )

    counts = [1, 2, 1, 0]
    assert [stage_layers(4, 4, s, counts) for s in range(4)] == [[0], [1, 2], [3], []]
    assert [stage_layers(4, 4, s) for s in range(4)] == [[0], [1], [2], [3]]  # equal
    assert stage_ids(0, 2, 2, "dualpipev") == [0, 3]  # rank 0: layer 0 and the head
    assert stage_modules(4, 1, 4, 3, counts) == ([4], False, True)  # the MTP module, the head
    assert stage_modules(4, 1, 4, 0, counts) == ([0], True, False)
    for s, want in enumerate([[0, 1, 2], [3]]):  # 3 + 1 under 1F1B, checked by validation
        assert stage_layers(4, 2, s, [3, 1]) == want
        dims_for(2, "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[3,1]")
    dims_for(2, "parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
             "parallel.pp_stage_layers=[1,2,1,0]")  # fmt: skip
    # DeepSeek-V3's 61 layers in 32 stages: the suggestion validation prints when no list is
    # given; the published recipe (Megatron-Core's "Et|(tt|)*30mL") is [1, 2 x 30, 0].
    assert suggested_stage_layers(61, 32) == [1] + [2] * 29 + [1, 1]
    assert suggested_stage_layers(2, 4) == [0, 1, 1, 0]
    assert suggested_stage_layers(1, 4) is None


def test_dp_is_derived_from_the_world_size() -> None:
    d = dims_for(8, "parallel.pp=2", "parallel.tp=2")
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp, d.dp) == (2, 1, 2, 2, 2)
    d = dims_for(8, "parallel.dp_replicate=2")
    assert (d.dp_replicate, d.dp_shard, d.dp) == (2, 4, 8)
    cfg = load_config(None, [*BASE, "parallel.pp=2", "parallel.pp_microbatches=4"])
    d = ParallelDims.from_config(cfg.parallel, 4).validate(cfg)
    assert (d.microbatches(cfg), d.micro_batch_size(cfg)) == (4, 2)


def test_rank_order_tp_fastest_pp_slowest() -> None:
    d = dims_for(8, "parallel.pp=2", "parallel.tp=2")
    assert [d.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [d.coords(r)["dp_shard"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [d.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4


def test_cp_sits_between_dp_shard_and_tp() -> None:
    d = dims_for(8, "parallel.cp=2", "parallel.tp=2")
    assert (d.dp_shard, d.cp, d.dp, d.dp_cp) == (2, 2, 2, 4)
    assert [d.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [d.coords(r)["cp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [d.coords(r)["dp_shard"] for r in range(8)] == [0] * 4 + [1] * 4


def test_breadth_and_depth_first_split_the_step_like_fast_llm() -> None:
    """Defaults: with a pipeline every micro-batch in one pass of the schedule, without one
    every micro-batch its own pass; one key set, the other is what the step leaves."""
    cases = [
        ((1, []), (8, 1, 8)),
        ((2, ["parallel.pp=2"]), (8, 8, 1)),
        ((2, ["parallel.pp=2", "parallel.depth_first_micro_batches=2"]), (8, 4, 2)),
        ((1, ["parallel.breadth_first_micro_batches=4"]), (8, 4, 2)),
        ((2, ["parallel.pp=2", "parallel.breadth_first_micro_batches=2"]), (8, 2, 4)),
    ]
    for (world, overrides), want in cases:
        cfg = load_config(None, [*BASE, *overrides])
        d = ParallelDims.from_config(cfg.parallel, world).validate(cfg)
        assert (d.microbatches(cfg), d.breadth_first(cfg), d.depth_first(cfg)) == want, overrides


def test_trainer_refuses_a_bad_layout_before_any_process_group(monkeypatch, tmp_path) -> None:
    import torch.distributed as dist

    from moetrain.train.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = load_config(None, [*BASE, "parallel.tp=3", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="does not divide the world size 8"):
        Trainer(cfg)
    assert not dist.is_initialized()
