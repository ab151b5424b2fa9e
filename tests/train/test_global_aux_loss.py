"""The global-batch balancing loss (``moe.global_aux_loss_coef``) against a hand computation.

The reference is written from the definition, on one forward of the whole global batch
through a plain model (no engine, no micro-batches): per MoE layer E * sum_e f_e * P_e with
f_e the fraction of the batch's T*K expert choices that picked e (no gradient) and P_e the
mean routing probability of e over the batch's tokens; its gradient by autograd. The engine
must reproduce it with the step cut into 4 micro-batches (the counting pre-pass) and as one
forward (counts summed between forward and backward). Micro-batch frequencies (what a
per-micro-batch loss or Megatron-Core's running average would use for the first micro-batch)
give a measurably different gradient: the test can fail.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from multirank import micro_config

from moetrain.data import PackedBatches, load_tokenizer
from moetrain.model import build_model
from moetrain.train.metrics import layer_summary
from moetrain.train.trainer import Trainer

COEF = 0.05
TOL = 1e-4
"""Worst error allowed, relative to each tensor's largest reference gradient..."""
NOISE = 1e-5
"""... plus this much of the LM gradient's largest element (fp32 rounding of the two runs'
gradients the loss's is the difference of; measured 1.8e-6)."""
# Only the global loss among the balancing losses; jitter on (the reference must draw the
# same factors: it sets the same jitter keys), drops on (f counts choices before drops).
OPTIONS = (
    "moe.aux_loss_coef=0.0",
    "moe.seq_aux_loss_coef=0.0",
    "moe.z_loss_coef=0.0",
    "moe.jitter_eps=0.1",
    "moe.capacity_factor=1.0",
)


def _first_step(out: str, *overrides: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The reduced gradients of the first step and its MoE statistics."""
    trainer = Trainer(micro_config(out, "train.steps=1", *OPTIONS, *overrides))
    grads: list[dict[str, torch.Tensor]] = []
    trainer.engine.grad_hook = lambda engine: grads.append(engine.full_grad_dict())
    res = trainer.train_step()
    trainer.close()
    return grads[0], res.moe


def _reference(micro_batches: int) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """The loss's gradient and per-layer value from the definition: one forward of the whole
    global batch, f counted over ``micro_batches`` equal slices of it (1: the whole batch,
    the definition; more: what per-micro-batch frequencies would give)."""
    with tempfile.TemporaryDirectory() as out:
        cfg = micro_config(out, *OPTIONS)
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    cfg.model.vocab_size = tok.vocab_size
    gbs = cfg.train.global_batch_size
    batch = PackedBatches(cfg.data, tok, "train", gbs, gbs).next_step()[0]["input_ids"]
    model = build_model(cfg.model, cfg.moe, seed=cfg.train.seed).train()
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in model.moe_layers().items():
        layer.set_jitter_key(cfg.train.seed, 0, 0)  # step 0, sequences from 0: the engine's
        layer.router.register_forward_hook(
            lambda _m, _i, r, i=i: seen.__setitem__(i, (r.scores_TE, r.ids_TK))
        )
    model(batch)
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    loss = torch.zeros(())
    values = {}
    for i, (scores_TE, ids_TK) in sorted(seen.items()):
        T = scores_TE.shape[0]
        per = T // micro_batches
        term = torch.zeros(())
        for j in range(micro_batches):
            rows = slice(j * per, (j + 1) * per)
            f_E = torch.zeros(E)
            for e in ids_TK[rows].flatten().tolist():
                f_E[e] += 1.0 / (per * K)
            term = term + E * (f_E * scores_TE[rows].mean(0)).sum() / micro_batches
        values[i] = float(term)
        loss = loss + COEF * term
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        n: (g if g is not None else torch.zeros_like(p))
        for (n, p), g in zip(params.items(), grads, strict=True)
    }, values


def _check_against_the_definition(mbs: int) -> None:
    """The engine's first step with micro-batches of ``mbs`` sequences against ``_reference``:
    the loss's gradient (with minus without it) and value."""
    with tempfile.TemporaryDirectory() as out:
        with_loss, moe = _first_step(
            out, f"moe.global_aux_loss_coef={COEF}", f"train.micro_batch_size={mbs}"
        )
    with tempfile.TemporaryDirectory() as out:
        without, _ = _first_step(
            out, "moe.global_aux_loss_coef=0.0", f"train.micro_batch_size={mbs}"
        )
    ref, values = _reference(1)
    # The same forward either way (the loss only adds a gradient): the difference of the two
    # runs' gradients is the global loss's, up to the fp32 rounding of the LM gradient it is
    # taken from (NOISE of that gradient's scale; a wrong f moves it by > 1e-2 of its own).
    wrong = []
    for name, g in ref.items():
        got = with_loss[name] - without[name]
        scale = g.abs().max().item()
        noise = NOISE * without[name].abs().max().item()
        err = (got - g).abs().max().item()
        if err > TOL * scale + noise:
            wrong.append((err / max(scale, 1e-30), name, err, scale))
    # Every wrong tensor, worst first.
    assert not wrong, "\n".join(
        f"{name}: error {err:.3g} of scale {scale:.3g}"
        for _, name, err, scale in sorted(wrong)[::-1]
    )
    gate = [n for n in ref if n.endswith("router.gate.weight")]
    assert gate and all(ref[n].abs().max() > 1e-6 for n in gate), "the loss moved no router"
    # Earlier layers get the loss's gradient too: routing depends on them.
    assert ref["tok_embeddings.weight"].abs().max() > 0
    for i, value in values.items():
        assert layer_summary(moe[i])["global_aux_loss"] == pytest.approx(value, rel=1e-5)


@pytest.mark.parametrize("mbs", [2, 8], ids=["4 micro-batches (counting pass)", "one forward"])
def test_global_balance_loss_gradient_and_value_match_the_definition(mbs: int) -> None:
    _check_against_the_definition(mbs)


def test_per_micro_batch_counts_planted_in_the_engine_are_caught(monkeypatch) -> None:
    """The escape this check exists for (tests/faults.py): each micro-batch's own counts in
    place of the step's, in every layout -- one process included, so the equivalence matrix
    cannot see it. The definition does, and names the routers."""
    from faults import plant

    plant("per_micro_batch_counts", monkeypatch.setattr)
    with pytest.raises(AssertionError, match=r"layers\.\d\.ffn\.router\.gate\.weight: error"):
        _check_against_the_definition(2)


def test_micro_batch_frequencies_would_give_another_gradient() -> None:
    """The check above can fail: f counted per micro-batch of 2 sequences moves the router
    gradients by far more than the tolerance."""
    exact, _ = _reference(1)
    local, _ = _reference(4)
    name = next(n for n in exact if n.endswith("router.gate.weight"))
    rel = (exact[name] - local[name]).abs().max() / exact[name].abs().max()
    assert rel > 100 * TOL, rel


def _layer_gate_gradient(compiled: bool, step_counts_E: torch.Tensor) -> torch.Tensor:
    """The router gate's gradient of one MoE layer with only the global-batch loss, the step
    counts handed over after the forward and before the backward (as the engine does with
    one forward per rank); ``compiled``: the layer under torch.compile (AOT autograd)."""
    import torch._dynamo

    from moetrain.config import MoEConfig
    from moetrain.model.moe import MoELayer

    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, kernels="torch",
                    global_aux_loss_coef=COEF, aux_loss_coef=0.0, seq_aux_loss_coef=0.0,
                    z_loss_coef=0.0)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(16, cfg).train()
    torch._dynamo.reset()
    run = torch.compile(layer, backend="aot_eager") if compiled else layer
    layer.global_balance.begin_step()
    y = run(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)))
    layer.global_balance.set_step_counts(step_counts_E)
    (y * 0).sum().backward()
    return layer.router.gate.weight.grad


def _gate_gradient_by_definition(step_counts_E: torch.Tensor) -> torch.Tensor:
    """d/dW of coef * E * sum_e f_e * P_e, f from ``step_counts_E``, P the mean softmax of
    the gate's logits (float64)."""
    torch.manual_seed(0)
    from moetrain.config import MoEConfig
    from moetrain.model.moe import MoELayer

    w = MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16)).router.gate.weight
    w = w.detach().double().requires_grad_()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).double().flatten(0, 1)
    f_E = step_counts_E.double() / step_counts_E.sum()
    loss = COEF * 4 * (f_E * torch.softmax(x @ w.T, -1).mean(0)).sum()
    return torch.autograd.grad(loss, w)[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_step_counts_handed_after_the_forward_reach_its_backward(compiled: bool) -> None:
    """The micro-batch's gradient reads f when its backward runs, compiled too: AOT autograd
    traces a backward when it compiles the forward, and read this forward's own f then (the
    term now runs eagerly: ``GlobalBalanceLoss.term``)."""
    counts = torch.tensor([100, 1, 1, 1])
    want = _gate_gradient_by_definition(counts)
    got = _layer_gate_gradient(compiled, counts)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL * want.abs().max().item(), f"gate gradient off by {err:.3g}"


def test_a_compiled_term_that_reads_f_at_trace_time_is_caught(monkeypatch) -> None:
    """The check above can fail: the term traced with the forward (no eager break)."""
    from moetrain.model.losses import GlobalBalanceLoss

    monkeypatch.setattr(GlobalBalanceLoss, "term", GlobalBalanceLoss.term.__wrapped__)
    with pytest.raises(AssertionError, match="gate gradient off by"):
        test_step_counts_handed_after_the_forward_reach_its_backward(compiled=True)
