"""What the model reads of the step it runs in: one object, owned by whoever runs the steps.

A ``Transformer`` makes one ``StepContext`` and hands it to every MoE layer it builds (an
``MoELayer`` built alone makes its own); all of them read it, none of them writes it. The
engine (``moetrain.train.engine.Engine``) takes the model's context before parallelizing it
and sets its fields: once per job (the aux-loss scale, the sequence shard) and around a
step's forwards (routing replay and record, the counting pass, eval routing). Pipeline
chunks are deep copies of one model that keep sharing it
(``moetrain.parallel.pipeline.pipeline_split``), so one assignment reaches every layer of
every chunk of the rank.

The attention modules read it too, for one field (``max_logits``: QK-clip's record).

Nothing else reaches the MoE layers from outside except the dispatcher
(``MoELayer.install_dispatcher``, the seam of expert parallelism). The layers' own
accumulations (statistics, the sequence counter, the global-batch loss's counts) are theirs
(``moetrain.model.moe_stats.MoEStats``, ``moetrain.model.losses.GlobalBalanceLoss``).

Under ``torch.compile`` the context is a Python object the compiled blocks read: dynamo guards
on the fields a forward reads, so a field that changes between steps recompiles. The fields
set per step are None/False outside the features that use them (replay, record, counting),
and the aux-loss scale is set once, before the first step.

Shape legend: G the step's global batch (sequences), S sequence, K top-k, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.model.sequence_shard import SequenceShard


@dataclass
class StepContext:
    """The per-step controls of a model's MoE layers (module doc)."""

    aux_loss_scale: float = 1.0
    """Gradient given to the balancing losses (and the multi-token-prediction loss) a layer
    injects: 1 / micro-batches per step, so that they are averaged over micro-batches
    exactly like the LM loss (``AuxLossInjector``)."""
    seq_shard: SequenceShard | None = None
    """Context parallelism: this process holds some positions of every sequence (RoPE, router
    jitter, capacity and the balancing statistics are those of the whole sequences). None:
    whole sequences."""
    replay: dict[int, torch.Tensor] | None = None
    """Routing replay in training: per MoE layer the step's expert ids (G, S, K), indexed by
    the global sequence index of the step (``moetrain.train.replay``). None: routers choose."""
    record: dict[int, torch.Tensor] | None = None
    """Routing record of a training step: per MoE layer (G, S, K) int64, -1 until the layer's
    training forwards write the rows of their sequences."""
    eval_record: dict[int, list[torch.Tensor]] | None = None
    """Eval routing: per MoE layer a list every eval forward appends its ids (T, K) to, on the
    CPU as int16."""
    counting: bool = False
    """The engine's counting pass (global-batch balancing): forwards that route and count
    their expert choices (``GlobalBalanceLoss.count``) and record nothing else."""
    max_logits: bool = False
    """QK-clip (``optim.qk_clip``): every attention module keeps each head's largest
    pre-softmax logit of the training forwards (``moetrain.model.attention.MaxLogits``). Set
    once per job."""
    zero_stage_input: bool = False
    """Set while the engine warms a pipeline up: a stage after the first zeroes the hidden
    states it is handed (``Transformer.forward``)."""
