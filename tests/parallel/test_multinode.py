"""Two "nodes" on one host: the SLURM batch script, run as SLURM would run it, launches two
torchrun agents of two processes each that meet through a c10d rendezvous on 127.0.0.1, and
train tp=2 x ZeRO-3 with the single process's losses and final parameters.

``srun`` and ``scontrol`` are stand-ins (a folder first on PATH): ``scontrol show
hostnames`` names 127.0.0.1, ``srun`` starts the command once per node of the allocation,
here, and waits for them all. Everything else is tools/slurm/train.sbatch as users submit
it: the rendezvous endpoint from the first node, one agent per node, ``torchrun -m
moetrain.train``. About a minute on 2 CPU cores (five interpreters importing torch).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from multirank import GRAD_TOL, MICRO, PARAM_TOL, VALUE_TOL, micro_run, noise_floor_slack

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "tools" / "slurm" / "train.sbatch"

SRUN = """#!/usr/bin/env bash
# srun for the test: one copy of the command per node of the allocation, on this host.
while [[ "${1:-}" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" >"agent$node.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1
"""
RUN = [*MICRO, "train.steps=2", "log.tensorboard=true"]
LAYOUT = ["parallel.tp=2", "parallel.zero_stage=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_result(run: Path) -> dict[str, object]:
    """The run's train losses by step and final parameters (its checkpoint, read into one
    process), named as ``micro_run`` names them."""
    from moetrain.interop.checkpoints import checkpoint_info, load_model
    from moetrain.train.metrics import read_scalars

    losses = [value for _, value in read_scalars(run)["train/loss"]]
    return {"loss": losses, "params": load_model(checkpoint_info(run)).state_dict()}


def _differences(got: dict, ref: dict) -> list[str]:
    """What differs beyond the oracle's fp32 tolerances (``TOLERANCES`` of tests/multirank.py):
    losses within the value row, final parameters within the param row, an element whose
    reference gradient stayed under the gradient check's noise floor within Adam's reach
    besides (``noise_floor_slack``, as ``compare_runs`` allows)."""
    out = []
    if len(got["loss"]) != len(ref["loss"]):
        return [f"{len(got['loss'])} logged losses vs {len(ref['loss'])}"]
    for step, (a, b) in enumerate(zip(got["loss"], ref["loss"], strict=True), 1):
        if abs(a - b) > VALUE_TOL["atol"] + VALUE_TOL["rtol"] * abs(b):
            out.append(f"loss at step {step}: {a} vs {b}")
    slack = noise_floor_slack(ref, GRAD_TOL["first"])
    for name, want in ref["params"].items():
        err = (got["params"][name].double() - want.double()).abs()
        allowed = PARAM_TOL["atol"] + PARAM_TOL["rtol"] * want.double().abs()
        allowed = allowed + slack.get(name, 0.0)
        if (err > allowed).any():
            out.append(f"{name}: max error {err.max().item():.2e}")
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_two_torchrun_agents_match_one_process(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "27",
        "NPROC_PER_NODE": "2", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
        "HF_DATASETS_OFFLINE": "1",
    }  # fmt: skip
    two = tmp_path / "two_nodes"
    config = tmp_path / "micro.yaml"  # the defaults: MICRO below makes it micro_run's model
    config.write_text("{}\n")
    command = ["bash", str(SBATCH), str(config), *RUN, *LAYOUT, f"train.output_dir={two}",
               "train.collective_timeout_s=120"]  # fmt: skip
    job = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    logs = "".join((tmp_path / f"agent{n}.log").read_text() for n in (0, 1))
    assert job.returncode == 0, job.stdout + job.stderr + logs
    assert "2 nodes x 2 processes, rendezvous 127.0.0.1:" in job.stdout
    # The layout ran: world 4 over the two agents, tp 2 inside each, ZeRO-3 across them.
    layout = "layout: world 4 = pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2; zero_stage 3"
    assert layout in logs, logs

    ref = micro_run(tmp_path / "one_process", 2, traffic=False)
    got = _two_node_result(two)
    assert not _differences(got, ref), _differences(got, ref)

    # The comparison can fail: a loss moved by 1e-3, one expert weight 0.1% off.
    name = next(k for k in ref["params"] if "experts.w1" in k)
    planted = {"loss": [got["loss"][0], got["loss"][1] + 1e-3],
               "params": {**got["params"], name: got["params"][name] * 1.001}}  # fmt: skip
    found = _differences(planted, ref)
    assert len(found) == 2 and found[0].startswith("loss at step 2") and name in found[1], found
