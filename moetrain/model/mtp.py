"""Multi-token prediction (DeepSeek-V3 report, section 2.2; GLM-4.5): D sequential modules,
the k-th predicting the token k + 1 places ahead of each position.

For depth k = 1..D and position i (0-based, T = the sequence length):

    h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]      i < T - k
    h^k    = TRM_k(h'^k)                                           (causal)
    P^k_i  = OutHead(RMSNorm(h_i^k))                               predicts t_{i+k+1}
    L^k    = -1/T sum_{i < T-k} log P^k_i[t_{i+k+1}]
    L_MTP  = lambda / D * sum_k L^k

h^0 is the main model's last hidden state (before its final norm); Emb and OutHead are the
main model's embedding and output (shared); M_k (``eh_proj``), the two norms, the block
TRM_k and the head's norm are the module's own. The concatenation puts the embedding first,
as DeepSeek's and GLM's checkpoints (``eh_proj`` of their extra layer) do. The label tensor
holds every token the modules need: t_{i+k} is labels[i + k - 1].

Every module runs over all T positions, as Megatron-Core's does: the token ids are shifted
(``shifted``), never the hidden states, and the last k positions of depth k -- which have no
target -- are computed and left out of the loss, of the balancing losses and of the router
statistics (``valid``, as padding is). Causal attention keeps them from touching the
positions that count, so the loss is the equations' exactly; and the hidden states keep
their layout: a sequence-parallel rank's positions stay its own (no shift across ranks), and
a pipeline's last stage needs only the token ids it already has as labels.

An ``MTPBlock`` (``moetrain.model.transformer``) is a transformer block with the module's
extra parts; the model keeps it in its ``layers`` under index ``n_layers + k - 1`` so that
every per-layer transform (FSDP, activation checkpointing, expert parallelism, tensor
parallelism, the pipeline's last stage) and every per-MoE-layer service (statistics,
balancing, the expert bias) covers it. Only training forwards given the labels run it.

Shape legend: B batch, T sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.precision import fp32_region

IGNORE_INDEX = -100
"""Label of a position left out of the loss (``F.cross_entropy``'s default ignore_index):
padding, under ``model.document_mask`` each document's separator (whose label is the next
document's first token), and the positions of a multi-token-prediction module without a
target."""


def shifted(labels_BT: torch.Tensor, k: int) -> torch.Tensor:
    """``labels`` moved k places left, the last k positions ``IGNORE_INDEX``: position i holds
    labels[i + k]."""
    if k == 0:
        return labels_BT
    pad = labels_BT.new_full((labels_BT.shape[0], min(k, labels_BT.shape[1])), IGNORE_INDEX)
    return torch.cat((labels_BT[:, k:], pad), dim=1)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism's ``loss_parallel``) as the
    plain tensor every rank holds; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def mtp_loss(
    blocks: list[nn.Module],
    h_BTD: torch.Tensor,
    labels_BT: torch.Tensor,
    embed: nn.Module,
    head: nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """sum_k L^k (unweighted) of the modules ``blocks`` (depth 1, 2, ...). ``labels_BT``: the
    next tokens, ``IGNORE_INDEX`` where they do not count (padding)."""
    B, T = labels_BT.shape
    total = torch.zeros((), device=h_BTD.device, dtype=torch.float32)
    h = h_BTD
    region = fp32_region("mtp", labels_BT.device.type)  # each depth's CE over fp32 logits
    for k, block in enumerate(blocks, start=1):
        if k >= T:  # no position has both t_{i+k} and a target t_{i+k+1}
            break
        ids_BT = shifted(labels_BT, k - 1).clamp_min(0)  # t_{i+k}; no-target rows read id 0
        targets_BT = shifted(labels_BT, k)  # t_{i+k+1}
        h, normed = block(h, embed(ids_BT), cos, sin, valid=targets_BT != IGNORE_INDEX)
        logits = head(normed)
        with region.autocast_off():
            ce = F.cross_entropy(region.cast(logits).flatten(0, 1), targets_BT.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
        total = total + _local(ce) / (B * T)
    return total
