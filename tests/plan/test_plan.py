"""``moetrain plan`` as a user runs it: the command and its exit statuses, refusals with the
trainer's own messages at any world size, the search, the constants as inputs, the page's
published-runs table against the file the tool writes, and DeepSeek-V3's experts at 2,048
ranks against a hand count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moetrain.cli import main as moetrain
from moetrain.config import ConfigError, load_config
from moetrain.parallel.dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]
TINY_EP = ["--config", "configs/tiny_ep.yaml", "--world", "8"]
PP1 = ["parallel.pp=1", "parallel.pp_virtual_stages=1", "parallel.pp_stage_layers=null"]
"""DeepSeek-V3 without its config's pipeline (2 stages a rank, uneven: both need one)."""


def test_plan_prints_every_figure_and_says_whether_it_fits(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    assert moetrain(["plan", *TINY_EP, "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    for line in ("layout: pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 2",
                 "ep 4 with expert tp", "parameters (local shards)", "optimizer states (float32)",
                 "start-up", ": fits 80 GB", "traffic per step", "ep   group of 4",
                 "estimate on h100"):  # fmt: skip
        assert line in out, (line, out)
    # The same plan through --json: one distinct rank (no pipeline), the figures as numbers.
    assert moetrain(["plan", *TINY_EP, "--gpu", "h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and len(data["ranks"]) == 1
    assert set(data["ranks"][0]["traffic"]) == {"dp", "tp", "ep"}  # edp = 4 / ep 4 = 1
    # Too little memory: exit status 1 and the advice.
    assert moetrain(["plan", *TINY_EP, "--gpu", "h100", "--memory-gb", "0.01"]) == 1
    assert "DOES NOT FIT 0.01 GB" in capsys.readouterr().out


def test_a_muon_plan_prices_its_gathers_and_newton_schulz(capsys, monkeypatch) -> None:
    """``optim.name=muon``: one buffer instead of two moments, a ``muon`` traffic axis (the
    sharded matrices gathered whole; exact against a real run in tests/plan/test_exact.py)
    and Newton-Schulz in the optimizer time; AdamW's plan has neither."""
    monkeypatch.chdir(REPO)
    assert moetrain(["plan", *TINY_EP, "--gpu", "h100", "--json"]) == 0
    adamw = json.loads(capsys.readouterr().out)["ranks"][0]
    assert moetrain(["plan", *TINY_EP, "optim.name=muon", "--gpu", "h100", "--json"]) == 0
    muon = json.loads(capsys.readouterr().out)["ranks"][0]
    assert adamw["muon_sent"] == adamw["muon_flops"] == 0 and "muon" not in adamw["traffic"]
    assert muon["muon_sent"] > 0 and muon["muon_flops"] > 0
    assert muon["traffic"]["muon"] == muon["muon_sent"]
    assert 0.5 * adamw["optim"] < muon["optim"] < adamw["optim"]  # matrices: 1 buffer, not 2
    assert moetrain(["plan", *TINY_EP, "optim.name=muon", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    # tiny_ep: ZeRO-0 over dp 4, tp 2: the tp blocks are what is gathered
    assert "muon group of 2" in out and "GFLOP of Newton-Schulz per step" in out, out


@pytest.mark.parametrize(
    "overrides",
    [
        # 61 layers do not split into 16 x 2 equal stages (the config's uneven ones do)
        ["parallel.pp_stage_layers=null"],
        [*PP1, "parallel.ep=3"],  # ep does not divide 256 experts
        [*PP1, "parallel.tp=3"],  # nor tp the world
        [*PP1, "train.global_batch_size=1920"],  # 1920 / dp 2048
    ],
)
def test_a_layout_refused_at_2048_ranks_is_refused_with_the_trainers_message(
    overrides, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(REPO)
    cfg = load_config("configs/deepseek_v3.yaml", overrides)
    with pytest.raises(ConfigError) as trainer:
        ParallelDims.from_config(cfg.parallel, 2048).validate(cfg)
    argv = ["plan", "--config", "configs/deepseek_v3.yaml", "--world", "2048", *overrides]
    assert moetrain(argv) == 2
    assert capsys.readouterr().err.strip() == f"moetrain: config error: {trainer.value}"


@pytest.mark.slow
def test_deepseek_v3_plans_in_its_published_pipeline_of_uneven_stages(capsys, monkeypatch) -> None:
    """The config as shipped: PP16 in DualPipe-V's V, 61 layers in 32 stages of [1, 2 x 30,
    0]. Every pipeline rank is planned; rank 0 holds the first stage (the embedding and
    layer 0) and the last (the output head alone), the others 2 + 2 layers."""
    monkeypatch.chdir(REPO)
    argv = ["plan", "--config", "configs/deepseek_v3.yaml", "--world", "2048", "--gpu", "h800"]
    assert moetrain([*argv, "--json"]) in (0, 1)  # planned (the start-up does not fit 80 GB)
    data = json.loads(capsys.readouterr().out)
    ranks = {r["coords"]["pp"]: r for r in data["ranks"]}
    assert sorted(ranks) == list(range(16))
    assert ranks[0]["stages"] == [0, 31] and ranks[0]["layers"] == [[0], []]
    for p in range(1, 16):
        first = 1 + 2 * (p - 1)
        last = 61 - 2 * p  # stage 31 - p: after 1 + 2 (30 - p) layers
        assert ranks[p]["stages"] == [p, 31 - p]
        assert ranks[p]["layers"] == [[first, first + 1], [last, last + 1]], p


def test_uneven_stages_are_priced_stage_by_stage_and_the_busiest_sets_the_pace() -> None:
    """Stages of 1 + 3 layers: each stage's FLOPs are its own layers' (the head's on the last
    stage), and both ranks' pipeline passes take the same time, the busier (3 layers and the
    head) idling less."""
    from moetrain.plan import hardware, planner
    from moetrain.plan.estimate import layer_flops_per_token, stage_flops_per_token
    from moetrain.train.engine import build_optimizers

    overrides = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[1,3]",
                 "model.tie_embeddings=false"]  # fmt: skip
    cfg = load_config(REPO / "configs/tiny.yaml", overrides)
    dims = ParallelDims.from_config(cfg.parallel, 2).validate(cfg)
    layer = [layer_flops_per_token(cfg, i, 1) for i in range(4)]
    head = 6 * cfg.model.dim * (cfg.model.vocab_size or 0)
    assert stage_flops_per_token(cfg, dims) == pytest.approx([layer[0], sum(layer[1:]) + head])
    plan = planner.plan(cfg, 2, build_optimizers, gpu=hardware.gpu("h100"))
    first, last = (r.estimate for r in plan.ranks)
    passes = [e.busy_s * (1 + e.bubble) for e in (first, last)]
    assert passes[0] == pytest.approx(passes[1])
    assert last.busy_s > first.busy_s and last.bubble < first.bubble


def test_search_ranks_what_fits_and_says_why_the_rest_does_not(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    argv = ["plan", *TINY_EP, "--gpu", "h100", "--search", "--memory-gb", "3",
            "parallel.pp=1", "parallel.cp=1", "parallel.activation_checkpointing=none"]  # fmt: skip
    assert moetrain(argv) == 0
    out = capsys.readouterr().out
    assert "fastest that fit (estimated):" in out
    # tp=8 leaves 6 heads whole on no rank: refused with validation's message.
    assert "x model.n_heads: 6 is not divisible by parallel.tp=8" in out
    rows = [line.split() for line in out.splitlines() if "zero_stage=" in line]
    times = [float(r[0]) for r in rows if len(r) > 3 and r[0][0].isdigit()]
    assert times == sorted(times) and len(times) >= 3


def test_every_constant_is_an_input() -> None:
    from moetrain.plan import hardware, planner
    from moetrain.train.engine import build_optimizers

    cfg = load_config(REPO / "configs/tiny_ep.yaml")

    def step(name: str = "h100", **consts) -> float:
        gpu = hardware.gpu(name, consts)
        return planner.plan(cfg, 8, build_optimizers, gpu=gpu).step_s

    base = step()
    assert step(nvlink_gbs=45.0) > base  # a tenth of the bandwidth: slower
    # On an H100 the GEMM and copy rates are measured rows; what is not measured is input:
    assert step(fp32_tflops=20.0) > base  # fp32 GEMMs (the router's; the experts' today)
    assert step(attention_efficiency=0.1) > base
    # Where no row is measured (B200), the datasheet figures times efficiencies price it.
    b200 = step("b200")
    assert step("b200", matmul_efficiency=0.3) > b200
    assert step("b200", copy_efficiency=0.3) > b200
    with pytest.raises(ValueError, match="not a GPU constant"):
        hardware.gpu("h100", {"no_such": 1.0})


def test_the_pages_gpu_table_is_the_code_s() -> None:
    """docs/plan.md's table of constants shows every GPU of ``hardware.GPUS`` (the one table
    that ``moetrain plan`` prices with and the trainer's MFU divides by) with its values; a
    GPU added to one and not the other, or a changed figure, fails here."""
    from moetrain.plan import hardware

    page = (REPO / "docs" / "plan.md").read_text()
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| `")]
    head = next(line for line in page.splitlines() if line.startswith("| constant |"))
    names = [c.strip() for c in head.strip("|").split("|")][1:-1]
    assert names == list(hardware.GPUS)
    shown = {r[0].strip("| ").split("`")[1]: r[1 : 1 + len(names)] for r in rows
             if r[0].strip("| ").split("`")[1] in hardware.GPU.__dataclass_fields__}  # fmt: skip
    assert set(shown) == set(hardware.GPU.__dataclass_fields__) - {"name", "arch"}
    for field, cells in shown.items():
        for gpu, cell in zip(names, cells, strict=True):
            want = getattr(hardware.GPUS[gpu], field)
            assert (cell == "-" and want == 0) or float(cell) == want, (field, gpu, cell)


def test_published_table_on_the_page_is_the_tools_file() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    import plan_published as P

    rows = P.read_rows()
    assert [r["run"] for r in rows] == [run.name for run in P.RUNS]
    page = (REPO / "docs" / "plan.md").read_text()
    assert P.render(rows) in page, "docs/plan.md: rerun python tools/plan_published.py --print"


def test_overlap_table_on_the_page_is_the_tools_file() -> None:
    """docs/plan.md's "Hiding the expert all-to-all" is tools/plan_overlap.py's CSV: every
    run under both schedules, the halves exposing less of the expert all-to-all than the
    plain one, which exposes all of it but the trip shared experts cover (half)."""
    sys.path.insert(0, str(REPO / "tools"))
    import plan_overlap as P

    rows = P.read_rows()
    assert sorted({r["run"] for r in rows}) == sorted(run.name for run in P.RUNS)
    for run in P.RUNS:
        mine = {r["schedule"]: r for r in rows if r["run"] == run.name}
        assert set(mine) == {"plain", "halves"}
        exposed = {k: float(r["ep_exposed_s"]) for k, r in mine.items()}
        cfg = load_config(REPO / run.config, run.layout)
        plain = float(mine["plain"]["ep_s"]) * (0.5 if cfg.moe.num_shared_experts else 1.0)
        assert exposed["halves"] < exposed["plain"] == pytest.approx(plain, abs=2e-3)
    page = (REPO / "docs" / "plan.md").read_text()
    assert P.render(rows) in page, "docs/plan.md: rerun python tools/plan_overlap.py --print"


@pytest.mark.slow
def test_deepseek_v3_at_2048_ranks_holds_its_experts_and_nothing_whole() -> None:
    """The whole 671B model on the meta device under a 2,048-rank fake process group: the
    planned rank holds exactly its 256 / ep experts of each of the 58 MoE layers (3 D F
    each, fp32), and its non-expert parameters sharded 2,048 ways (ZeRO-3: each one's first
    dimension cut in 2,048 chunks of ceil(n / 2,048) rows, as FSDP2 pads them)."""
    import torch

    from moetrain.model.transformer import Transformer
    from moetrain.plan import planner
    from moetrain.train.engine import build_optimizers

    overrides = [*PP1, "parallel.ep=64", "parallel.zero_stage=3",
                 "train.global_batch_size=16384"]  # fmt: skip
    cfg = load_config(REPO / "configs/deepseek_v3.yaml", overrides)
    plan = planner.plan(cfg, 2048, build_optimizers)
    s = plan.ranks[0].state
    moe_layers = 61 - 3
    assert s.expert_elements == moe_layers * (256 // 64) * 3 * 7168 * 2048
    assert s.n_params == 671_026_404_352
    with torch.device("meta"):
        whole = Transformer(cfg.model, cfg.moe)
    padded = sum(
        -(-p.shape[0] // 2048) * p[0].numel()
        for name, p in whole.named_parameters()
        if ".experts." not in name
    )
    assert s.params == 4 * (s.expert_elements + padded)
    # Start-up: the shards and buffers alone on a GPU (the init's blocks are drawn in host
    # memory; the largest is one expert's D x F); rank 0 re-pads no FSDP shard.
    assert s.init_block == 4 * 7168 * 2048 and s.repad == 0
    assert plan.start_up == s.params + s.buffers


def test_start_up_counts_fsdp_repadding_an_uneven_shard() -> None:
    """An uneven first dim (a 4,097-token vocabulary over 2 ZeRO-3 ranks: 2,049 and 2,048
    rows): the last rank's shard is copied into its padded buffer when it gets storage, so
    its start-up holds that copy's source at once; rank 0's shard is the padded size."""
    import tempfile

    import torch
    from multirank import micro_config

    from moetrain.plan.build import build_rank
    from moetrain.plan.planner import Plan, plan_rank
    from moetrain.train.engine import build_optimizers

    cfg = micro_config(tempfile.mkdtemp(), "model.vocab_size=4097", "parallel.zero_stage=3",
                       "train.global_batch_size=4")  # fmt: skip
    dims = ParallelDims.from_config(cfg.parallel, 2).validate(cfg)
    states = [build_rank(cfg, dims, rank, build_optimizers, "cpu") for rank in (0, 1)]
    assert [s.repad for s in states] == [0, 2048 * cfg.model.dim * 4]
    for s in states:
        rp = plan_rank(cfg, dims, s, torch.float32, "cpu")
        plan = Plan(cfg, dims, "cpu", torch.float32, [rp])
        assert plan.start_up_of(rp) == s.params + s.buffers + max(s.init_block, s.repad)


def test_the_halves_schedule_is_priced_on_its_timeline() -> None:
    """``parallel.ep_overlap=halves``: the plan runs a block's 12 phases (two halves'
    attention, experts and combine, forward and backward) on a timeline where each of the 8
    transfers arrives a transfer's time after its issue, and prices what is left exposed.
    By hand, for phases of 5.8 / 4.7 / 1.8 (backward 11.6 / 9.4 / 1.8):
    10 per transfer: forward experts 0 start at 15.8, experts 1 at 21.6, combine 0 at 30.5,
    combine 1 at 36.3, end 38.1 (13.5 exposed); backward experts 1' start at 11.8, experts
    0' at 21.2, attention 1' at 31.2, attention 0' at 42.8, end 54.4 (8.8 exposed).
    5 per transfer: 3.5 + 3.2. Transfers shorter than every phase hide whole. The plan's
    exposed ep time is that, per MoE block and micro-batch, with the phases from its own
    compute parts."""
    from moetrain.plan import hardware, planner
    from moetrain.plan.estimate import HalfPhases, half_phases, halves_exposed
    from moetrain.train.engine import build_optimizers

    phases = HalfPhases(5.8, 4.7, 1.8)
    assert halves_exposed(10.0, phases) == pytest.approx(13.5 + 8.8)
    assert halves_exposed(5.0, phases) == pytest.approx(3.5 + 3.2)
    assert halves_exposed(1.0, phases) == pytest.approx(0.0)
    assert halves_exposed(0.0, phases) == 0.0
    no_sp = ["parallel.sequence_parallel=false", "moe.token_group_seqs=1"]
    exposed = {}
    for overlap in ("none", "halves"):
        cfg = load_config(REPO / "configs/tiny_ep.yaml", [*no_sp, f"parallel.ep_overlap={overlap}"])
        plan = planner.plan(cfg, 8, build_optimizers, gpu=hardware.gpu("h100"))
        rank = plan.ranks[0]
        e = rank.estimate
        exposed[overlap] = e.exposed_s["ep"]
    dims = ParallelDims.from_config(cfg.parallel, 8).validate(cfg)
    m = dims.microbatches(cfg)
    blocks = sum(len(c.layers) for c in rank.state.chunks) * m
    moe_blocks = sum(layer.moe for c in rank.state.chunks for layer in c.layers) * m
    copy_bps = e.rates["copy"].value * 1e9
    from moetrain.model.precision import Precision

    element = Precision.choose(cfg.train.dtype, "cuda").dtype.itemsize
    ph = half_phases(cfg, dims, e.parts, blocks, moe_blocks, copy_bps, element)
    assert ph.experts > 0 and ph.combine > 0 and ph.attention > 0
    tau = e.comm_s["ep"] / (8 * moe_blocks)
    assert exposed["none"] == pytest.approx(e.comm_s["ep"])  # nothing hidden without it
    assert exposed["halves"] == pytest.approx(moe_blocks * halves_exposed(tau, ph))
    assert exposed["halves"] < exposed["none"]
