"""The process a run lives in: its log handler, its device, its process group and its random
generators' state (saved in every checkpoint and restored on resume)."""

from __future__ import annotations

import logging
import os
import random
import sys
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moetrain.config import ConfigError


def setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(message)s",
            datefmt="%H:%M:%S",
            stream=sys.stdout,
        )


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device: 'cuda' requested but no CUDA device is available; use 'auto' or 'cpu'"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_s: int) -> None:
    """Start the default process group (gloo on CPU, nccl on CUDA) for a torchrun launch;
    nothing for one process or when a process group already exists (tests). A collective
    that some rank never joins (a dead rank) fails after ``timeout_s``."""
    if world_size() == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
    )


def rng_state() -> dict[str, Any]:
    """RNG states as plain containers and tensors (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
