"""The multi-rank harness itself: results come back in rank order, a failure is reported
with its traceback and kills the other ranks instead of hanging them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from multirank import RankFailure, run_ranks


def _sum_ranks(rank: int, world_size: int, scale: int) -> float:
    t = torch.tensor(float(rank * scale))
    dist.all_reduce(t)
    return float(t)


def _rank1_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one broke")
    dist.barrier()  # rank 0 would wait here forever without the harness


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_results_in_rank_order_and_failures_reported() -> None:
    assert run_ranks(_sum_ranks, 3, 2, timeout=60) == [6.0, 6.0, 6.0]
    with pytest.raises(RankFailure, match="(?s)rank 1 failed.*ValueError: rank one broke"):
        run_ranks(_rank1_fails, 2, timeout=60)


def _rank1_aborts(rank: int, world_size: int) -> None:
    if rank == 1:
        print("rank one's last words", flush=True)
        os.abort()  # a signal: no Python exception, no report
    dist.barrier()


def _rank1_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        import time

        time.sleep(600)
    dist.barrier()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_shows_its_output_and_stack() -> None:
    """A rank that dies without a report (an abort, a segfault) leaves only its output: the
    failure quotes it, with the Python stack faulthandler printed as it died."""
    with pytest.raises(RankFailure) as err:
        run_ranks(_rank1_aborts, 2, timeout=60)
    text = str(err.value)
    assert "rank 1 died with exit code -6" in text, text
    assert "--- rank 1, exit code -6, output:" in text, text
    assert "rank one's last words" in text, text
    assert "Fatal Python error: Aborted" in text and "_rank1_aborts" in text, text


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_rank_past_the_deadline_shows_where_it_waits() -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(_rank1_hangs, 2, timeout=8)
    text = str(err.value)
    assert "still running after 8 s" in text, text
    # Each late rank's threads, as faulthandler prints them on the harness's signal.
    assert "--- rank 1" in text and "_rank1_hangs" in text, text


def _rank0_fails_while_rank1_waits(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("rank zero's own error")
    import time

    time.sleep(600)  # not in a collective: nothing tells this rank its peer is gone


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_failure_shows_where_a_silent_peer_waits() -> None:
    """The peer of a failed rank that is still running, and has printed nothing, is asked for
    its stacks too: a gloo rendezvous that rank 0 saw closed by its peer ("connectFullMesh
    failed ... Connection closed by peer", rare under load; pytorch/pytorch#53270) left rank 1
    alive and silent, and the report said nothing of where it was."""
    with pytest.raises(RankFailure) as err:
        run_ranks(_rank0_fails_while_rank1_waits, 2, timeout=60)
    text = str(err.value)
    assert "rank 0 failed" in text and "rank zero's own error" in text, text
    assert "--- rank 1" in text and "_rank0_fails_while_rank1_waits" in text, text


def _environment(rank: int, world_size: int) -> tuple[str | None, str | None, str]:
    return os.environ.get("MOETRAIN_HARNESS_PROBE"), os.environ.get("HOME"), os.environ["RANK"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_ranks_see_the_callers_environment(monkeypatch) -> None:
    """Each rank sees the caller's environment as it is at the call, set or unset since an
    earlier call (``_entry`` replaces the rank's environment with the caller's)."""
    run_ranks(_sum_ranks, 2, 1, timeout=60)
    monkeypatch.setenv("MOETRAIN_HARNESS_PROBE", "set after the first call")
    monkeypatch.delenv("HOME", raising=False)
    got = run_ranks(_environment, 2, timeout=60, init_pg=False)
    assert got == [("set after the first call", None, "0"),
                   ("set after the first call", None, "1")], got  # fmt: skip


def _sum_tensors(rank: int, world_size: int, tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.sum() for t in tensors.values()))


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd (Linux)")
def test_tensor_arguments_leave_no_descriptor_behind() -> None:
    """Arguments travel as bytes: tensors handed to the ranks (the cached single-process
    references) are not moved into shared memory that this process holds open with a file
    descriptor per storage for the rest of the session (the suite ran out of descriptors)."""
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(64)}
    before = _open_descriptors()
    assert run_ranks(_sum_tensors, 2, tensors, timeout=60) == [8064.0, 8064.0]
    assert _open_descriptors() - before < 8  # 64 storages would hold 64
    assert not any(t.is_shared() for t in tensors.values())


def _report(param: torch.Tensor, grads: list[torch.Tensor], lrs: list[float]) -> dict:
    return {"loss": [1.0], "grad_norm": [1.0], "moe": [{}], "params": {"w": param},
            "grads": [{"w": g} for g in grads], "lrs": lrs}  # fmt: skip


def test_parameter_slack_is_only_for_gradients_below_the_noise_floor() -> None:
    """An element whose gradient was below the gradient check's floor may differ by up to
    2 x the sum of the lrs from that step on (Adam's normalised steps of a gradient whose sign
    nothing pins); the same difference on an element with a real gradient, or beyond the
    reach, still fails."""
    from multirank import compare_runs

    grads = [torch.tensor([1.0, 1e-8]), torch.tensor([0.5, -1e-8])]
    ref = _report(torch.tensor([0.3, 0.3]), grads, [1e-3, 2e-3])
    quiet = _report(torch.tensor([0.3, 0.3 + 5e-3]), grads, [1e-3, 2e-3])
    compare_runs(quiet, ref)  # 5e-3 < 2 x 3e-3 on the quiet element
    loud = _report(torch.tensor([0.3 + 5e-3, 0.3]), grads, [1e-3, 2e-3])
    with pytest.raises(AssertionError, match=r"param\[w\]"):
        compare_runs(loud, ref)
    far = _report(torch.tensor([0.3, 0.3 + 7e-3]), grads, [1e-3, 2e-3])
    with pytest.raises(AssertionError, match=r"slack 0.006"):
        compare_runs(far, ref)
    # Quiet at the first step only (a token first seen in the second batch): every update
    # from the first on may differ (slack 2 x 3e-3); quiet from the second step on: only the
    # second's (2 x 2e-3).
    grads = [torch.tensor([1e-8, 1.0]), torch.tensor([0.5, -1e-8])]
    ref = _report(torch.tensor([0.3, 0.3]), grads, [1e-3, 2e-3])
    compare_runs(_report(torch.tensor([0.3 + 5e-3, 0.3 + 3e-3]), grads, [1e-3, 2e-3]), ref)
    with pytest.raises(AssertionError, match=r"slack 0.004"):
        compare_runs(_report(torch.tensor([0.3, 0.3 + 5e-3]), grads, [1e-3, 2e-3]), ref)


def _server_threads(rank: int, world_size: int) -> tuple[int, bool]:
    import sys

    from harness import RANK_SERVER

    server = sys.modules.get(RANK_SERVER)
    return (server.THREADS if server else -1), "datasets" in sys.modules


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.environ.get("MOETRAIN_TEST_SPAWN") == "1", reason="ranks are spawned")
def test_ranks_are_forked_from_a_server_that_held_one_thread() -> None:
    """Each rank is a fork of the fork server after it imported torch (tests/rank_server.py),
    which then held one thread: nothing it imported started one, ``datasets`` among them."""
    assert run_ranks(_server_threads, 2, timeout=60, init_pg=False) == [(1, False), (1, False)]


def test_a_fork_from_a_server_holding_a_thread_or_without_its_imports_is_refused(
    monkeypatch,
) -> None:
    import sys
    import types

    import harness

    monkeypatch.setitem(sys.modules, "rank_server", types.SimpleNamespace(THREADS=1))
    harness.forked_from_one_thread()
    monkeypatch.setitem(sys.modules, "rank_server", types.SimpleNamespace(THREADS=2))
    with pytest.raises(RuntimeError, match="held 2 threads"):
        harness.forked_from_one_thread()
    monkeypatch.delitem(sys.modules, "rank_server")
    with pytest.raises(RuntimeError, match="did not import rank_server"):
        harness.forked_from_one_thread()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts /proc/self/task (Linux)")
def test_the_servers_thread_count_sees_what_datasets_starts() -> None:
    """The count ``_entry`` checks can fail: the server's imports plus ``datasets`` (pyarrow's
    jemalloc thread, what an earlier server held when ranks died of SIGABRT) are more than
    one thread. Counted in a fresh interpreter, as the server imports."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    probe = "import rank_server, datasets; print(rank_server.THREADS, rank_server.thread_count())"
    env = {**os.environ, "PYTHONPATH": tests}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()  # fmt: skip
    assert int(out[0]) == 1 and int(out[1]) > 1, out
