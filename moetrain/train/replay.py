"""Routing replay in training (``train.routing_replay``) and the routing record
(``train.record_routing``) it reads.

One file per optimizer step, ``step_<8-digit step>.pt`` (steps count from 1, as checkpoints
and TensorBoard do), in the routing-trace format of ``tools/routing_trace.py``: a
``torch.save`` of plain tensors and containers, loadable with ``weights_only=True``::

    format       "moetrain.routing_trace/1"
    step         int: the optimizer step it is for
    num_experts  int, top_k: int, layers: [int]   (the MoE layers it holds)
    input_ids    int64 (N, B, S): the step's global batch, N * B = train.global_batch_size
                 sequences of S = data.seq_len tokens, in the data stream's order
    ids          {layer: int (N, B*S, K)}: the expert ids of every token, any integer dtype
    losses       float64 (N,) (optional; the record writes the step's loss)

An inference engine that generated the rollouts writes these from the expert choices it
made: sequence n * B + b of the file is global sequence n * B + b of the step, whatever the
layout trains it with. Replay checks the file against the step before using it (its
input_ids, shapes, the MoE layers, expert ids in range); layers of the file that are not MoE
layers of the model are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moetrain.config import ConfigError

FORMAT = "moetrain.routing_trace/1"


def step_file(directory: str | Path, step: int) -> Path:
    return Path(directory).expanduser() / f"step_{step:08d}.pt"


def load_replay_step(
    directory: str | Path,
    step: int,
    moe_layers: list[int],
    global_batch_size: int,
    seq_len: int,
    num_experts: int,
    top_k: int,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(input_ids (global batch, S), {layer: int64 ids (global batch, S, K)}) of ``step``,
    checked; raises ``ConfigError`` naming ``train.routing_replay``."""
    path = step_file(directory, step)
    key = "train.routing_replay"
    if not path.is_file():
        raise ConfigError(f"{key}: no routing for step {step} ({path} does not exist)")
    try:
        trace = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error
        raise ConfigError(f"{key}: {path} is not a routing file ({exc})") from None
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path} is not a routing trace ({FORMAT})")
    inputs = trace.get("input_ids")
    ids = trace.get("ids")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 3 or not isinstance(ids, dict):
        raise ConfigError(
            f"{key}: {path} needs input_ids (N, B, S) and ids {{layer: (N, B*S, K)}}"
        )
    N, B, S = inputs.shape
    if N * B != global_batch_size or S != seq_len:
        raise ConfigError(
            f"{key}: {path} holds {N * B} sequences of {S} tokens; the step has "
            f"train.global_batch_size={global_batch_size} of data.seq_len="
            f"{seq_len}"
        )
    out = {}
    for layer in moe_layers:
        if layer not in ids:
            raise ConfigError(
                f"{key}: {path} has no routing for MoE layer {layer} (it has layers {sorted(ids)})"
            )
        t = ids[layer]
        if tuple(t.shape) != (N, B * S, top_k):
            raise ConfigError(
                f"{key}: {path} layer {layer}: ids of shape {tuple(t.shape)}, "
                f"expected {(N, B * S, top_k)} (moe.top_k={top_k})"
            )
        t = t.to(torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
            raise ConfigError(
                f"{key}: {path} layer {layer}: expert ids outside "
                f"[0, moe.num_experts={num_experts})"
            )
        out[layer] = t.reshape(N * B, S, top_k)
    return inputs.reshape(N * B, S).to(torch.int64), out


def routing_trace(
    step: int, record: dict[str, Any], num_experts: int, top_k: int, loss: float
) -> dict[str, Any]:
    """A routing trace (the format of ``tools/routing_trace.py``) holding ``record``
    (``input_ids`` (sequences, S), ``ids`` {layer: (sequences * S, K)}) as one micro-batch."""
    inputs = record["input_ids"]
    G, S = inputs.shape
    return {
        "format": FORMAT, "checkpoint": "", "step": int(step), "num_experts": num_experts,
        "top_k": top_k, "layers": sorted(record["ids"]),
        "input_ids": inputs.reshape(1, G, S).to(torch.int64),
        "losses": torch.tensor([loss], dtype=torch.float64),
        "ids": {i: t.reshape(1, G * S, -1).to(torch.int16) for i, t in record["ids"].items()},
    }  # fmt: skip


def save_record(
    directory: str | Path,
    step: int,
    record: dict[str, Any],
    num_experts: int,
    top_k: int,
    loss: float,
) -> Path:
    """Write a step's routing (``Engine.routing_record()``) as ``step_<step>.pt``."""
    trace = routing_trace(step, record, num_experts, top_k, loss)
    path = step_file(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(trace, tmp)
    tmp.replace(path)
    return path
