"""``train.compile=true`` stays compiled: each compiled frame is compiled once (at most a
second time, static to dynamic), whatever the routing does to per-expert token counts, and
the grouped GEMMs that CUDA runs natively are inside the graph.

On the first GPU run the compiled blocks recompiled until dynamo gave up (the per-expert
loop's ``offs_E.tolist()`` broke the graph and its slices were compiled in for every new
set of offsets); on CPU the MoE forward recompiled for every step and every layer (the
router jitter's step and layer were int attributes, compiled in as constants). The test
compiles with a backend that runs dynamo's graphs as they are (what recompiles and where the
graph breaks is dynamo's doing, whatever backend compiles the graphs), and takes CUDA's
eligibility rules for ``torch._grouped_mm`` (``gemm_torch.cuda_rules``: bf16 operands).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch._dynamo
from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch
from multirank import micro_config
from torch._dynamo.utils import counters
from torch._guards import CompileContext

from moetrain.train.trainer import Trainer

STEPS = 4


def _compiled_run(monkeypatch, dtype: str, *extra: str) -> tuple[dict[int, set[int]], dict, list]:
    """(compile indices of every compiled frame, dynamo's graph-break reasons, each step's
    tokens per expert of layer 0 and attention maxima) of ``STEPS`` dropless steps of the
    micro MoE compiled, ``train.dtype=dtype``, with the ``extra`` overrides."""
    compiles: dict[int, set[int]] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compile_id = CompileContext.current_compile_id()
        compiles.setdefault(compile_id.frame_id, set()).add(compile_id.frame_compile_id)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch._dynamo.reset()
    counters.clear()
    loads = []
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(
            out, "train.compile=true", f"train.dtype={dtype}", "moe.kernels=torch",
            "moe.capacity_factor=null", "moe.jitter_eps=0.1", "model.n_layers=2",
            "train.global_batch_size=4", "log.histogram_every=0", *extra,
        ))  # fmt: skip
        with gemm_torch.cuda_rules():
            for _ in range(STEPS):
                res = trainer.train_step()
                loads.append((res.moe[0]["tokens_per_expert"].tolist(), res.max_logits))
        trainer.close()
    return compiles, dict(counters["graph_break"]), loads


def test_native_grouped_gemms_compile_once_without_a_graph_break(monkeypatch) -> None:
    compiles, breaks, loads = _compiled_run(monkeypatch, "bf16")
    # the routing moved tokens between experts
    assert len({tuple(x) for x, _ in loads}) > 1, loads
    assert not breaks, breaks
    assert compiles, "nothing was compiled"
    recompiled = {frame: ids for frame, ids in compiles.items() if max(ids) > 1}
    assert not recompiled, compiles


def test_qk_clips_record_compiles_without_a_graph_break(monkeypatch) -> None:
    """The attention keeps its heads' maxima inside the compiled block (``optim.qk_clip``):
    no graph break, at most two compiles (before and after its first record)."""
    compiles, breaks, loads = _compiled_run(monkeypatch, "bf16", "optim.qk_clip=0.05")
    assert not breaks, breaks
    assert all(sorted(logits) == [0, 1] for _, logits in loads), loads
    recompiled = {frame: ids for frame, ids in compiles.items() if max(ids) > 1}
    assert not recompiled, compiles


@pytest.mark.slow  # 17 s on 2 cores
def test_the_per_expert_loop_runs_eagerly_and_recompiles_nothing(monkeypatch) -> None:
    """fp32 operands, which CUDA's ``torch._grouped_mm`` does not take: the per-expert loops
    (host-read offsets) run outside the graph, and the frames around them still compile at
    most twice."""
    compiles, breaks, _ = _compiled_run(monkeypatch, "fp32")
    assert breaks and all("_loop" in reason for reason in breaks), breaks
    recompiled = {frame: ids for frame, ids in compiles.items() if max(ids) > 1}
    assert not recompiled, compiles


INDUCTOR_LAYER = textwrap.dedent("""
    import torch
    from moetrain.config import MoEConfig
    from moetrain.model.moe import MoELayer

    for capacity in (None, 1.0):
        torch.manual_seed(0)
        cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64, capacity_factor=capacity,
                        jitter_eps=0.3, kernels="torch", token_group_seqs=None)
        layer = MoELayer(64, cfg)
        layer.set_jitter_key(seed=3, step=5, seq_offset=2)
        x = torch.randn(2, 32, 64, requires_grad=True)

        def step(x_BSD):
            layer.stats.rows.zero_()  # the same sequences each call, so the same jitter
            return layer(x_BSD)

        outs = []
        for run in (step, torch.compile(step)):
            y = run(x)
            outs.append((y.detach(), *torch.autograd.grad(y.square().sum(), x)))
        for got, want in zip(outs[1], outs[0]):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    print("ok")
""")


@pytest.mark.slow
def test_inductor_compiles_the_moe_layer_as_eager_computes_it() -> None:
    """inductor's CPU code for an MoE layer with router jitter (dropless and with capacity),
    forward and backward, equals eager. The jitter hashes with wrapping 64-bit products:
    computed from loop indices in inductor's C++, they are signed overflows the compiler may
    assume never happen (a fused kernel read out of bounds here while the key was ints and
    the per-feature hashes computed in the graph; they are now inputs: ``jitter_key``,
    ``jitter_hashes``). In a subprocess: a miscompiled kernel may take the interpreter
    down with it."""
    proc = subprocess.run(
        [sys.executable, "-c", INDUCTOR_LAYER], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]
