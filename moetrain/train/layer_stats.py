"""A step's MoE statistics over the whole job, and the expert-bias update that reads them.

Every MoE layer counts its training forwards in its ``MoEStats`` (``moetrain.model.moe_stats``)
and hands them over with ``pop_stats()``; ``LayerStats`` packs every layer's into one float64
row per layer (``moe_stats.pack``, fields by name), sums them over dp x cp and pp in two
collectives, takes the maxima (``moe_stats.MAX_NAMES``: the largest receive buffer) over the
same ranks in two more, and reads them all to the host in one copy, whatever the number of
layers.

``LayerStats`` is a collaborator of ``moetrain.train.engine.Engine``, handed this rank's MoE
layers, the whole model's MoE layer indices, the expert count, the step's groups, the device
and quantile balancing's bins per expert (0: off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetrain.model.moe import MoELayer
from moetrain.model.moe_stats import MAX_NAMES, pack, packed_width, unpack
from moetrain.train.step_groups import StepGroups


class LayerStats:
    def __init__(
        self,
        layers: dict[int, MoELayer],
        layer_ids: list[int],
        num_experts: int,
        groups: StepGroups,
        device: torch.device,
        quantile_bins: int = 0,
    ) -> None:
        self.layers = layers
        self.layer_ids = layer_ids
        self.num_experts = num_experts
        self.groups = groups
        self.device = device
        self.quantile_bins = quantile_bins
        # The last ``pop`` result and its statistics still on the device.
        self._on_device: tuple[object, dict[int, dict[str, torch.Tensor]]] = (None, {})

    @torch.no_grad()
    def pop(self) -> dict[int, dict[str, torch.Tensor]]:
        """Pop every MoE layer's statistics and return them for all layers, summed over dp
        and pp (each layer lives on one pp rank; tp ranks hold identical copies, not summed).
        Token counts are counted on the source rank over all experts, so summing over dp
        counts each assignment once under expert parallelism too; ``a2a_bytes`` (token bytes
        sent to other EP ranks in forward) is summed over dp and pp but not tp: under tp > 1
        it is the bytes of one tp index (every tp rank sends the same). ``recv_rows_max`` is
        the maximum over the same ranks. The expert bias is a state, identical over dp:
        returned as is."""
        ids = self.layer_ids
        if not ids:
            return {}
        E, bins = self.num_experts, self.quantile_bins
        packed = torch.zeros(len(ids), packed_width(E, bins), dtype=torch.float64,
                             device=self.device)  # fmt: skip
        maxima = torch.zeros(len(ids), len(MAX_NAMES), dtype=torch.float64, device=self.device)
        for row, i in enumerate(ids):
            if i in self.layers:
                stats = self.layers[i].pop_stats()
                packed[row] = pack(stats, E, bins)
                maxima[row] = torch.stack([stats[name].double() for name in MAX_NAMES])
        g = self.groups
        for group in (g.dp, g.pp):  # dp x cp: cp ranks count their own tokens
            if group is None:
                continue
            dist.all_reduce(packed, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
            if group is g.dp:
                packed[:, -E:] /= g.dp_cp_size  # the expert bias (last)
        # The expert-bias update reads the counts where they are (``update_expert_bias``).
        on_device = {i: unpack(packed[row], E, bins) for row, i in enumerate(ids)}
        # every layer's statistics in one read (a host sync)
        host = torch.cat([packed, maxima], 1).float().cpu()
        width = packed.shape[1]
        out = {}
        for row, i in enumerate(ids):
            out[i] = unpack(host[row, :width], E, bins)
            out[i].update(zip(MAX_NAMES, host[row, width:].unbind(), strict=True))
        self._on_device = (out, on_device)
        return out

    def update_expert_bias(self, stats: dict[int, dict[str, torch.Tensor]]) -> None:
        """Aux-loss-free or quantile balancing from the GLOBAL statistics: every rank moves
        the bias of the layers it holds identically."""
        last, on_device = self._on_device
        for i, layer in self.layers.items():
            # ``pop``'s own result: its statistics still on the device (a copy back from the
            # host would wait for the device to finish).
            if stats is last:
                s = on_device[i]
            else:
                s = {name: value.to(self.device) for name, value in stats[i].items()}
            layer.update_expert_bias(s["tokens_per_expert"].float(), s["qb_hist"], s["assignments"])
