"""What a training step waits for and what its gradient norm reads, counted on CPU.

On a GPU every host sync (``.item()``, ``.tolist()``, ``.cpu()``, ``bincount`` sizing its
output, boolean-mask indexing) stalls the launch queue, and a norm computed through fp64
copies moves several times the bytes of one fused fp32 read. ``StepCensus``
(``moetrain.plan.census``) counts both on CPU. The grouped GEMMs take the path CUDA takes
(``gemm_torch.cuda_rules``: ``torch._grouped_mm`` for bf16 operands only; CPU's kernel would
take fp32 too, and its per-expert loop reads the offsets on the host).
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch
from multirank import micro_config

from moetrain.plan.census import StepCensus
from moetrain.train.trainer import Trainer

BF16_NATIVE = ("train.dtype=bf16", "moe.kernels=torch", "log.histogram_every=0")


def _bf16_trainer(out: str, *overrides: str) -> Trainer:
    return Trainer(micro_config(out, *BF16_NATIVE, *overrides))


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("moe.capacity_factor=null", "moe.jitter_eps=0.1"), id="dropless-jitter"),
        pytest.param(("moe.capacity_factor=1.0", "moe.drop_policy=probs"), id="capacity"),
        pytest.param(("moe.capacity_factor=1.0", "moe.pad_to_capacity=true"), id="padded"),
    ],
)
def test_native_forward_and_backward_make_no_host_sync(options: tuple[str, ...]) -> None:
    """The model's forward and backward on the bf16 native path read nothing on the host:
    routing, capacity planning, dispatch, the grouped GEMMs, the balancing losses and the
    statistics (with some tokens left out of them, ``valid``) all stay on the device."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _bf16_trainer(out, *options)
        model, engine = trainer.engine.parts[0], trainer.engine
        inputs, labels, _ = engine._batch_inputs(trainer.train_data.next_step()[0])
        valid = torch.ones(labels.shape, dtype=torch.bool)
        valid[0, :5] = False  # the statistics leave these out (masking, not indexing)
        with gemm_torch.cuda_rules(), StepCensus() as census:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(inputs, valid=valid)
            engine._ce(logits, labels).backward()
        trainer.close()
    assert census.sync_count() == 0, census.report()
    # The routed experts ran torch._grouped_mm, forward (3) and backward (dgrad, wgrad: 6).
    layers = len(trainer.engine.moe)
    assert census.matmul_calls[("_grouped_mm", torch.bfloat16)] == 9 * layers, census.report()


def _step_syncs(layers: int) -> dict[str, int]:
    """The host syncs of one training step (its second: the optimizer state exists) of the
    micro MoE with ``layers`` layers; AdamW's step counts, which torch keeps on the host
    whatever the device, are not syncs."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _bf16_trainer(out, f"model.n_layers={layers}", "moe.capacity_factor=null")
        with gemm_torch.cuda_rules():
            trainer.train_step()
            steps = [s["step"] for opt in trainer.engine.optimizers for s in opt.state.values()]
            with StepCensus(host_tensors=steps) as census:
                trainer.train_step()
        micro_batches = trainer.engine.n_micro
        trainer.close()
    print(census.report())
    return {"micro_batches": micro_batches, **census.syncs}


def test_a_step_makes_the_same_few_host_syncs_at_any_depth() -> None:
    """A whole step -- forwards, backwards, the loss, the gradient norm, clipping, the
    non-finite check, AdamW, the expert-bias update and the statistics the trainer logs --
    waits for the device three times whatever the number of layers: the loss, the gradient
    norm (both read as floats), and every layer's statistics in one copy. The other reads
    are of each micro-batch's labels (``Engine._batch_inputs``), which stay on the host."""
    one, two = _step_syncs(1), _step_syncs(2)
    assert one == two
    assert two == {
        "micro_batches": 4,
        "_local_scalar_dense": 4 + 2,  # the labels of each micro-batch; the loss, the norm
        "cpu": 1,  # the statistics of every layer
    }, two


def test_the_gradient_norm_reads_every_gradient_once_in_its_dtype() -> None:
    """``Engine.grad_norm`` reads each fp32 gradient once, 4 bytes an element, in one fused
    norm (``torch._foreach_norm``, accumulating in fp64): no fp64 copy of any gradient, and
    the fp64 norm of every gradient to fp64's rounding."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out))
        engine = trainer.engine
        batch = trainer.train_data.next_step()[0]
        inputs, labels, kwargs = engine._batch_inputs(batch)
        engine._ce(engine.parts[0](inputs, **kwargs), labels).backward()
        grads = [p.grad for p in engine.parts[0].parameters() if p.grad is not None]
        with StepCensus() as census:
            norm = engine.grad_norm()
        trainer.close()
    elements = sum(g.numel() for g in grads)
    assert census.norm_bytes == {torch.float32: 4 * elements}, census.report()
    assert census.cast_elements[(torch.float32, torch.float64)] == 0, census.report()
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert float(norm) == pytest.approx(want, rel=1e-12)
