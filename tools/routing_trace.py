"""Record which experts every eval token is routed to, per MoE layer, from a checkpoint.

    python tools/routing_trace.py outputs/tiny -o trace.pt                  # latest checkpoint
    python tools/routing_trace.py outputs/tiny \\
        --checkpoint outputs/tiny/checkpoints/step_00000100 --batches 4 -o trace_100.pt

The trace is a ``torch.save`` file of plain tensors and containers (load it with
``torch.load(path, weights_only=True)`` or ``load_trace``)::

    format      "moetrain.routing_trace/1"
    checkpoint  str, step: int, num_experts: int, top_k: int, layers: [int]
    input_ids   int64 (N, B, S)    the N eval micro-batches, to check a replay sees the same
    losses      float64 (N,)       eval loss of each micro-batch
    ids         {layer: int16 (N, B*S, K)}   expert ids per token, by descending score

It runs the run's own eval split (``train.eval_batches`` micro-batches unless --batches),
in fp32, through the public API: the run's ``config.yaml``, ``empty_model``,
``PackedBatches`` and ``CheckpointManager.load``. ``tools/offline_ablation.py`` replays it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from moetrain.config import JobConfig, load_config
from moetrain.data import PackedBatches, load_tokenizer
from moetrain.model import Transformer, empty_model
from moetrain.model.moe import RoutingOverride
from moetrain.train.checkpoint import CheckpointManager

FORMAT = "moetrain.routing_trace/1"
Batch = dict[str, torch.Tensor]


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None,
             device: str = "cpu") -> tuple[JobConfig, Transformer, Path, int]:
    """A run's config and its model with the weights of ``checkpoint`` (default: the latest),
    in eval mode; also the checkpoint path and its step."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    model = empty_model(cfg.model, cfg.moe, device)  # the checkpoint fills every weight
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.train.keep_last)
    path = Path(checkpoint) if checkpoint is not None else manager.latest()
    if path is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no complete checkpoint")
    state = {"model": get_model_state_dict(model)}
    extra = manager.load(path, state)
    set_model_state_dict(model, state["model"])
    model.eval()
    return cfg, model, path, int(extra["step"])


def eval_batches(cfg: JobConfig, n: int | None = None) -> list[Batch]:
    """The first ``n`` (default ``train.eval_batches``) micro-batches of the eval split: the
    ones the trainer's evaluation uses."""
    n = n or cfg.train.eval_batches
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    mbs = cfg.train.micro_batch_size
    data = PackedBatches(cfg.data, tokenizer, "eval", n * mbs, mbs)
    data.reset()
    return data.next_step()


def batch_loss(model: Transformer, batch: Batch) -> float:
    device = next(model.parameters()).device
    logits = model(batch["input_ids"].to(device))
    return F.cross_entropy(logits.float().flatten(0, 1),
                           batch["labels"].to(device).flatten()).item()


@torch.no_grad()
def evaluate(model: Transformer, batches: list[Batch],
             override: Callable[[int, int], RoutingOverride | None] | None = None,
             record: dict[int, list[torch.Tensor]] | None = None) -> list[float]:
    """Per-batch eval losses. ``override(layer, batch_index)`` sets each router's
    ``routing_override`` for that batch; ``record`` collects each layer's ids_TK."""
    routers = {i: layer.router for i, layer in model.moe_layers().items()}
    hooks = []
    if record is not None:
        for i, router in routers.items():
            record.setdefault(i, [])
            hooks.append(router.register_forward_hook(
                lambda _m, _in, out, i=i: record[i].append(out.ids_TK.to("cpu", torch.int16))))
    model.eval()
    losses = []
    try:
        for b, batch in enumerate(batches):
            for i, router in routers.items():
                router.routing_override = override(i, b) if override is not None else None
            losses.append(batch_loss(model, batch))
    finally:
        for router in routers.values():
            router.routing_override = None
        for h in hooks:
            h.remove()
    return losses


def record_trace(model: Transformer, batches: list[Batch], checkpoint: str = "",
                 step: int = -1) -> dict[str, Any]:
    record: dict[int, list[torch.Tensor]] = {}
    losses = evaluate(model, batches, record=record)
    layers = sorted(record)
    any_layer = next(iter(model.moe_layers().values()))
    return {
        "format": FORMAT, "checkpoint": str(checkpoint), "step": step,
        "num_experts": any_layer.num_experts, "top_k": any_layer.cfg.top_k, "layers": layers,
        "input_ids": torch.stack([b["input_ids"] for b in batches]),
        "losses": torch.tensor(losses, dtype=torch.float64),
        "ids": {layer: torch.stack(record[layer]) for layer in layers},
    }


def save_trace(trace: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(trace, path)


def load_trace(path: str | Path) -> dict[str, Any]:
    trace = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ValueError(f"{path}: not a routing trace ({FORMAT})")
    return trace


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run directory (train.output_dir)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    parser.add_argument("--batches", type=int, help="eval micro-batches (default: "
                        "train.eval_batches)")
    parser.add_argument("-o", "--out", default="routing_trace.pt")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    cfg, model, path, step = load_run(args.run, args.checkpoint, args.device)
    trace = record_trace(model, eval_batches(cfg, args.batches), str(path), step)
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {len(trace['layers'])} MoE layers x {len(trace['losses'])} "
          f"batches, checkpoint step {step}, eval loss {trace['losses'].mean().item():.4f}")
    return trace


if __name__ == "__main__":
    main(sys.argv[1:])
