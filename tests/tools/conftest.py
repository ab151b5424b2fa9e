"""Shared fixtures of the tool tests: a two-point router sweep on a micro config, trained once
per session through ``moetrain ablate``, whose runs the report and ablation tests read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml
from threads import one_thread

TOOLS = Path(__file__).resolve().parents[2] / "tools"

# A model that trains a step in well under a second on a CPU (as tests/train uses).
MICRO = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.ffn_dim": 128, "model.max_seq_len": 64,
    "moe.num_experts": 4, "moe.expert_ffn_dim": 64, "moe.capacity_factor": 1.0,
    "moe.token_group_seqs": 2, "moe.expert_bias_rate": 0.01, "moe.jitter_eps": 0.01,
    "data.seq_len": 32, "train.global_batch_size": 8, "train.micro_batch_size": 2,
    "train.steps": 3, "train.eval_every": 2, "train.eval_batches": 2,
    "train.checkpoint_every": 2, "optim.warmup_steps": 2,
    "log.log_every": 1, "log.progress_bar": False, "log.heatmap_every": 2,
    "log.histogram_every": 2,
}
GRID = {"moe.top_k": [1, 2]}


def load_tool(name: str):
    """Import tools/<name>.py (tools/ is not a package)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def write_sweep(path: Path, **extra) -> Path:
    path.write_text(yaml.safe_dump({"overrides": MICRO, "grid": GRID, **extra}))
    return path


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory) -> Path:
    """The sweep directory after ``moetrain ablate sweep.yaml --out DIR`` finished, trained
    on ``one_thread()``: a test that resumes one of its runs compares the eval loss exactly,
    and computes on the same threads whatever the setting of the test that built this
    session fixture (tests/threads.py)."""
    from moetrain.cli import main

    root = tmp_path_factory.mktemp("sweep")
    sweep_file = write_sweep(root / "sweep.yaml")
    out = root / "out"
    with one_thread():
        assert main(["ablate", str(sweep_file), "--out", str(out)]) == 0
    return out
