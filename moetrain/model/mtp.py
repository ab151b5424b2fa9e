"""Multi-token prediction (DeepSeek-V3 report, section 2.2; GLM-4.5): D sequential modules,
the k-th predicting the token k + 1 places ahead of each position.

For depth k = 1..D and position i (0-based, T = the sequence length):

    h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]      i < T - k
    h^k    = TRM_k(h'^k)                                           (causal, over T - k positions)
    P^k_i  = OutHead(RMSNorm(h_i^k))                               predicts t_{i+k+1}
    L^k    = -1/T sum_i log P^k_i[t_{i+k+1}]
    L_MTP  = lambda / D * sum_k L^k

h^0 is the main model's last hidden state (before its final norm); Emb and OutHead are the
main model's embedding and output (shared); M_k (``eh_proj``), the two norms, the block
TRM_k and the head's norm are the module's own. The concatenation puts the embedding first,
as DeepSeek's and GLM's checkpoints (``eh_proj`` of their extra layer) do. The label tensor
holds every token the modules need: t_{i+k} is labels[i + k - 1].

An ``MTPBlock`` (``moetrain.model.transformer``) is a transformer block with the module's
extra parts; the model keeps it in
its ``layers`` under index ``n_layers + k - 1`` so that every per-layer transform (FSDP,
activation checkpointing, expert parallelism) and every per-MoE-layer service (statistics,
balancing, the expert bias) covers it. Only training forwards given the labels run it.

Shape legend: B batch, T sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mtp_loss(
    blocks: list[nn.Module],
    h_BTD: torch.Tensor,
    labels_BT: torch.Tensor,
    embed: nn.Module,
    head: nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """sum_k L^k (unweighted) of the modules ``blocks`` (depth 1, 2, ...)."""
    B, T = labels_BT.shape
    total = torch.zeros((), device=h_BTD.device, dtype=torch.float32)
    h = h_BTD
    for k, block in enumerate(blocks, start=1):
        n = T - k  # positions that have both t_{i+k} and a target t_{i+k+1}
        if n <= 0:
            break
        emb = embed(labels_BT[:, k - 1 : k - 1 + n])
        h, normed = block(h[:, :n], emb, cos, sin)
        logits = head(normed)
        with torch.autocast(device_type=labels_BT.device.type, enabled=False):
            ce = F.cross_entropy(logits.float().flatten(0, 1), labels_BT[:, k:].flatten(),
                                 reduction="sum")  # fmt: skip
        total = total + ce / (B * T)
    return total
