"""The MoE layer's seams (moetrain/model/step_context.py, moe_stats.py, losses.py): what reaches
the layer comes through its step context, its dispatcher or its own methods, and what it
accumulates lives in objects read by name.

- the package, read from its source: no module outside ``moetrain/model`` assigns an attribute
  of an MoE layer (the dispatcher goes through ``install_dispatcher``), only the training
  layer writes the step context;
- one context per model, shared by its layers and by the pipeline chunks cut from it;
- each per-step control of the context changes what the layer does: a replayed routing, a
  record, eval routing, the counting pass (which counts and records nothing else);
- the statistics object snapshots and restores every counter it holds, and ``pop_stats``
  reads them by name.
Each check is also seen failing on a planted regression.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig, ParallelConfig
from moetrain.model.moe import MoELayer
from moetrain.model.moe_stats import MAX_NAMES, MoEStats, pack, packed_width, unpack
from moetrain.model.step_context import StepContext
from moetrain.model.transformer import build_model
from moetrain.parallel.pipeline import pipeline_split

ROOT = Path(__file__).resolve().parents[2]
D, E, K = 8, 4, 2


def _layer(**moe) -> MoELayer:
    cfg = MoEConfig(num_experts=E, top_k=K, expert_ffn_dim=8, kernels="torch", **moe)
    torch.manual_seed(0)
    return MoELayer(D, cfg).train()


def _x(B: int = 2, S: int = 4) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- the source


def _layer_attributes() -> set[str]:
    """Every name an MoE layer answers to as its own: instance attributes, submodules,
    buffers, parameters and properties, and the per-step controls it once carried."""
    layer = _layer()
    names = {n for n in vars(layer) if not n.startswith("_")}
    names |= set(layer._modules) | set(layer._buffers) | set(layer._parameters)
    names |= {n for n, v in vars(MoELayer).items() if isinstance(v, property)}
    old = {"replay_BSK", "record_BSK", "eval_record", "counting", "aux_loss_scale",
           "route_counts", "global_counts", "global_counts_ready"}  # fmt: skip
    return (names | old) - {"training"}


def _stores(path: Path) -> list[tuple[int, str, str]]:
    """(line, base expression, attribute) of every attribute assignment in ``path`` whose
    base is not ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    base = ast.unparse(sub.value)
                    if base != "self":
                        out.append((node.lineno, base, sub.attr))
    return out


def _outside_model() -> list[Path]:
    return [p for p in (ROOT / "moetrain").rglob("*.py") if "model" not in p.parts]


def layer_attribute_stores(files: list[Path]) -> list[str]:
    """Assignments, outside the model package, of an MoE layer's own names on anything but
    ``self`` or a step context (whose writers the next test checks; GroupedExperts'
    ``num_experts``, which apply_ep sets on the experts it slices, aside). The dispatcher is
    installed through ``MoELayer.install_dispatcher``."""
    names = _layer_attributes()
    found = []
    for path in files:
        for line, base, attr in _stores(path):
            context = base.endswith(("context", "ctx"))
            if attr in names and not context and not (attr, base) == ("num_experts", "experts"):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{line}: {base}.{attr} = ...")
    return found


def test_no_package_assigns_the_moe_layers_attributes() -> None:
    assert not layer_attribute_stores(_outside_model())


def test_an_attribute_assigned_from_outside_is_seen(tmp_path: Path) -> None:
    """The scan above can fail: the engine of before (an attribute per control) is caught."""
    planted = tmp_path / "engine.py"
    planted.write_text(
        "def step(moe, replay):\n"
        "    for i, layer in moe.items():\n"
        "        layer.replay_BSK = replay[i]\n"
        "        layer.dispatcher = None\n"
    )
    found = layer_attribute_stores([planted])
    assert [f.split(": ")[1] for f in found] == [
        "layer.replay_BSK = ...", "layer.dispatcher = ..."]  # fmt: skip


def test_only_the_training_layer_writes_the_step_context() -> None:
    fields = set(StepContext.__dataclass_fields__)
    writers = sorted(
        f"{path.relative_to(ROOT)}:{line}: {base}.{attr}"
        for path in (ROOT / "moetrain").rglob("*.py")
        for line, base, attr in _stores(path)
        if attr in fields and ("context" in base or "ctx" in base)
    )
    assert writers, "the engine sets the context: the scan found no writer at all"
    outside = [w for w in writers if not w.startswith("moetrain/train/")]
    assert not outside, outside


# ---------------------------------------------------------------- one context, shared


def _model(n_layers: int = 4):
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      ffn_dim=24, max_seq_len=16)  # fmt: skip
    moe = MoEConfig(num_experts=E, top_k=K, expert_ffn_dim=8, kernels="torch")
    return build_model(cfg, moe, seed=0)


def test_every_layer_reads_the_models_one_context() -> None:
    model = _model()
    layers = model.moe_layers()
    assert layers and all(m.step_context is model.step_context for m in layers.values())


def test_pipeline_chunks_share_the_context_they_were_cut_from() -> None:
    model = _model()
    parts, _ = pipeline_split(model, 0, ParallelConfig(pp=2, pp_schedule="Interleaved1F1B",
                                                       pp_virtual_stages=2))  # fmt: skip
    assert len(parts) == 2
    layers = [m for p in parts for m in p.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.step_context is model.step_context for m in layers)
    assert all(p.step_context is model.step_context for p in parts)


def test_a_chunk_copied_on_its_own_would_not_share_it(monkeypatch) -> None:
    """The check above can fail: chunks deep-copied without the shared context (a plain
    ``copy.deepcopy``) each get a context of their own."""
    import copy
    from types import SimpleNamespace

    import moetrain.parallel.pipeline as pipeline

    plain = SimpleNamespace(deepcopy=lambda m, memo=None: copy.deepcopy(m))
    monkeypatch.setattr(pipeline, "copy", plain)
    model = _model()
    parts, _ = pipeline_split(model, 0, ParallelConfig(pp=2))
    assert parts[0].step_context is not model.step_context


# ---------------------------------------------------------------- the controls


def test_replay_in_the_context_routes_the_layer() -> None:
    layer = _layer()
    B, S = 2, 4
    t = torch.arange(B * S)
    replay_GSK = torch.stack([t % E, (t * 3 + 1) % E], -1).view(B, S, K)
    layer.step_context.replay = {0: replay_GSK}
    layer(_x(B, S))
    stats = layer.pop_stats()
    want = torch.bincount(replay_GSK.flatten(), minlength=E).float()
    assert torch.equal(stats["tokens_per_expert"], want)
    layer.step_context.replay = {1: replay_GSK}  # another layer's: this one must not read it
    with pytest.raises(KeyError):
        layer(_x(B, S))


def test_record_and_eval_record_take_what_the_router_chose() -> None:
    layer = _layer()
    B, S = 2, 4
    chosen = []
    layer.router.register_forward_hook(lambda _m, _i, r: chosen.append(r.ids_TK))
    ctx = layer.step_context
    ctx.record = {0: torch.full((3, S, K), -1, dtype=torch.int64)}
    layer.set_jitter_key(0, 0, 1)  # this forward's sequences are sequences 1, 2 of the step
    layer(_x(B, S))
    assert torch.equal(ctx.record[0][0], torch.full((S, K), -1))
    assert torch.equal(ctx.record[0][1:], chosen[-1].view(B, S, K))
    ctx.eval_record = {0: []}
    with torch.no_grad():
        layer.eval()(_x(B, S))
    assert torch.equal(ctx.eval_record[0][0], chosen[-1].to(torch.int16))


def test_the_counting_pass_counts_and_records_nothing_else() -> None:
    layer = _layer(jitter_eps=0.1, global_aux_loss_coef=0.1)
    B, S = 2, 4
    ctx = layer.step_context
    ctx.record = {0: torch.full((B, S, K), -1, dtype=torch.int64)}
    layer.global_balance.begin_step()
    before = layer.stats.snapshot()
    ctx.counting = True
    with torch.no_grad():
        layer(_x(B, S))
    ctx.counting = False
    after = layer.stats.snapshot()
    assert int(after["rows"]) == B  # the next micro-batch's sequences
    assert all(torch.equal(before[n], after[n]) for n in MoEStats.FIELDS if n != "rows")
    assert int(layer.global_balance.counts_E.sum()) == B * S * K
    assert int(ctx.record[0].max()) == -1


# ---------------------------------------------------------------- the statistics object


def test_snapshot_and_restore_cover_every_counter() -> None:
    layer = _layer(quantile_balancing=True, quantile_balancing_bins=16)  # every counter in use
    saved = layer.stats.snapshot()
    assert set(saved) == set(MoEStats.FIELDS)
    assert set(MoEStats.FIELDS) == set(layer.stats._buffers), "a counter outside FIELDS"
    layer(_x())
    moved = [n for n in MoEStats.FIELDS if not torch.equal(getattr(layer.stats, n), saved[n])]
    assert sorted(moved) == sorted(MoEStats.FIELDS), "a forward left a counter alone"
    layer.stats.restore(saved)
    assert all(torch.equal(getattr(layer.stats, n), saved[n]) for n in MoEStats.FIELDS)


@pytest.mark.parametrize("bins", [0, 16], ids=["no quantile balancing", "quantile balancing"])
def test_pop_stats_packs_and_unpacks_by_name(bins: int) -> None:
    layer = _layer(quantile_balancing=bins > 0, quantile_balancing_bins=max(bins, 2))
    layer(_x())
    layer(_x())
    stats = layer.pop_stats()
    row = pack(stats, E, bins)
    assert row.shape == (packed_width(E, bins),)
    back = unpack(row, E, bins)
    assert set(back) | set(MAX_NAMES) == set(stats)  # the maxima travel beside the row
    for name, value in stats.items():
        if name not in MAX_NAMES:
            assert torch.equal(back[name], value.double()), name
    assert float(stats["calls"]) == 2.0
    # Two forwards of the same tokens: the rows received summed, and their maximum one's.
    assert float(stats["recv_rows"]) == 2 * float(stats["recv_rows_max"]) > 0
    assert float(layer.pop_stats()["calls"]) == 0.0  # popped: reset
