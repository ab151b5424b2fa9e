"""The rows each rank's experts receive: per layer, the busiest rank's over the mean.

Under expert parallelism the busiest rank sets the pace and, dropless, the size of the
receive buffer a step needs. Every MoE layer counts the rows its experts received in each
training forward (``MoEStats.recv_rows`` and its maximum ``recv_rows_max``; exact per rank
against a count from the routing ids in tests/ep/test_ep_layer.py); ``LayerStats`` sums the
first and takes the maximum of the second over the data-parallel ranks and pipeline stages,
and the TensorBoard scalar ``moe/layer{L}/recv_rows_max_over_mean`` is their ratio (the HTML
report draws it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from multirank import micro_config, run_ranks

REPO = Path(__file__).resolve().parents[2]


class _Layer:
    """A layer that hands over fixed statistics (the fields ``LayerStats`` reads)."""

    def __init__(self, recv_rows: float, recv_rows_max: float, calls: float) -> None:
        from moetrain.model.moe_stats import COUNT_NAMES, SCORE_HIST_BINS, STAT_NAMES

        self.stats = {name: torch.zeros(()) for name in (*STAT_NAMES, *COUNT_NAMES)}
        self.stats.update(tokens_per_expert=torch.ones(4), score_hist=torch.zeros(SCORE_HIST_BINS),
                          probs_sum=torch.zeros(4), qb_hist=torch.zeros(4, 0),
                          expert_bias=torch.zeros(4), a2a_bytes=torch.zeros(()),
                          recv_rows=torch.tensor(recv_rows),
                          recv_rows_max=torch.tensor(recv_rows_max))  # fmt: skip
        self.stats["calls"] = torch.tensor(calls)

    def pop_stats(self) -> dict[str, torch.Tensor]:
        return self.stats


def _reduced(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from moetrain.train.layer_stats import LayerStats
    from moetrain.train.metrics import layer_summary
    from moetrain.train.step_groups import StepGroups

    # Two forwards each: rank 0 received 4 and 6 rows, rank 1 10 and 20.
    layer = _Layer(recv_rows=[10.0, 30.0][rank], recv_rows_max=[6.0, 20.0][rank], calls=2.0)
    groups = StepGroups(dp=dist.group.WORLD, seq=dist.group.WORLD, dp_size=world,
                        dp_cp_size=world)  # fmt: skip
    stats = LayerStats({0: layer}, [0], 4, groups, torch.device("cpu")).pop()[0]  # type: ignore[dict-item]
    return {k: float(v) for k, v in layer_summary(stats).items() if k.startswith("recv")}


def _trained(rank: int, world: int, out: str) -> dict[str, list[float]]:
    from moetrain.train.metrics import read_scalars
    from moetrain.train.trainer import Trainer

    trainer = Trainer(micro_config(
        out, "parallel.ep=2", "moe.force_load_balancing=true", "train.benchmark=true",
        "train.steps=2", "log.tensorboard=true", "log.log_every=1"))  # fmt: skip
    trainer.fit()
    trainer.close()
    if rank:
        return {}
    scalars = read_scalars(out)
    return {tag: [v for _, v in points] for tag, points in scalars.items()
            if tag.endswith("recv_rows_max_over_mean")}  # fmt: skip


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_busiest_ranks_rows_are_a_scalar_per_layer() -> None:
    # By hand: 40 rows over 4 forwards is a mean of 10; the busiest forward took 20.
    for summary in run_ranks(_reduced, 2):
        assert summary == {"recv_rows_max": 20.0, "recv_rows_max_over_mean": 2.0}
    # Balanced routing under ep=2: every rank receives as many rows in every forward, so
    # the ratio is 1 (a maximum summed over the two ranks would read 2).
    with tempfile.TemporaryDirectory() as out:
        curves = run_ranks(_trained, 2, out)[0]
        assert len(curves) == 4, curves  # one per MoE layer
        for tag, values in curves.items():
            assert values == [1.0, 1.0], (tag, values)
        # imported here: the ranks import this module, where ``conftest`` may be another one
        from conftest import load_tool

        html = Path(out) / "report.html"
        load_tool("expert_report").main([out, "-o", str(html)])
        page = html.read_text()  # the summary table's column (the curves are images)
        assert "peak rows received max/mean" in page, page
