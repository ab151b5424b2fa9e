"""The multi-rank process harness: run a function on N CPU processes with gloo.

    def _worker(rank: int, world_size: int, x: int) -> float:
        ...  # the default process group is initialised (gloo), torch uses one thread
        return some_picklable_value

    results = run_ranks(_worker, 4, 3, timeout=120)   # [rank 0's result, rank 1's, ...]

``fn`` must be a module-level function (it is pickled by reference). Ranks are forked from a
fork server that imported torch once (``_context``). Each run gets its own
rendezvous file in a fresh temporary directory, the process group a short timeout, and the
parent a wall-clock deadline: if any rank raises, dies or the deadline passes, every child is
killed and ``RankFailure`` is raised with the failing rank's traceback and its output (each
rank's stdout and stderr go to a log the failure quotes). A test never hangs.

Nothing here knows what the ranks compute: the micro model is tests/micro.py, the oracle
that compares runs tests/oracle.py. Test files import all three through tests/multirank.py.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from threads import ORACLE_THREADS

__all__ = ["PG_TIMEOUT_S", "RankFailure", "run_ranks"]


PG_TIMEOUT_S = 60
"""Timeout of the gloo process group: a collective some rank never joins fails after this."""


class RankFailure(RuntimeError):
    """A rank raised, died, or the run passed its deadline. The message holds the traceback."""


def _entry(
    rank: int,
    world_size: int,
    rendezvous: str,
    fn: Callable[..., Any],
    args_bytes: bytes,
    results: Any,
    init_pg: bool,
    environ: dict[str, str],
    log: str,
    forked: bool,
) -> None:
    import torch.distributed as dist

    # The rank's stdout and stderr go to its log, which a failure quotes (_with_output): what a
    # rank prints as it dies (an abort's message, faulthandler's stack of every thread on a
    # fatal signal) would otherwise go to the parent's descriptors, out of any report.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks' deadline asks for stacks

    os.environ.clear()  # exactly the caller's environment
    os.environ.update(environ)

    # torchrun's variables, so that code reading them (the trainer) sees a normal launch.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(ORACLE_THREADS)  # as every run it is compared with (tests/threads.py)
    try:
        if forked:
            forked_from_one_thread()
        if init_pg:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{rendezvous}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=PG_TIMEOUT_S),
            )
        args = torch.load(io.BytesIO(args_bytes), weights_only=False)
        out = fn(rank, world_size, *args)
        # Bytes, not tensors: torch's queue pickler would pass tensors as shared-memory
        # handles that die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker")
"""What gloo says on a rank whose peer went away: the peer's own failure is the cause."""


def _root_failure(
    name: str, results: Any, failures: dict[int, str], procs: list[Any], done: dict[int, Any]
) -> RankFailure:
    """The failure that caused the others. A failing rank's report can arrive after its
    peers': ``Queue.put`` hands it to a feeder thread while the rank goes on to destroy its
    process group, and the peers fail on the closed connection. So the other ranks' reports
    are read for a few seconds, and the first one that is not a lost peer is blamed; if each is
    a lost peer, a rank that died without a report (its exit code: a signal, a hard abort)."""
    end = time.monotonic() + 5.0
    while len(failures) + len(done) < len(procs) and time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            continue
        if not ok:
            failures[rank] = value
    rank = next((r for r, v in failures.items() if not any(s in v for s in PEER_LOST)), None)
    silent = [r for r, p in enumerate(procs)
              if r not in failures and r not in done and p.exitcode not in (None, 0)]  # fmt: skip
    if rank is None and silent:
        return RankFailure(
            f"{name}: rank {silent[0]} died with exit code {procs[silent[0]].exitcode} without "
            f"a report; ranks {sorted(failures)} lost it as a peer. Rank "
            f"{next(iter(failures))}:\n{next(iter(failures.values()))}"
        )
    rank = next(iter(failures)) if rank is None else rank
    others = sorted(set(failures) - {rank})
    tail = f"\n(ranks {others} failed too, on lost peers or the same error)" if others else ""
    return RankFailure(f"{name}: rank {rank} failed:\n{failures[rank]}{tail}")


RANK_OUTPUT_CHARS = 4000
"""About how much of a failed rank's output a ``RankFailure`` quotes (``_shorten``)."""


def _log(tmp: str, rank: int) -> str:
    return str(Path(tmp) / f"rank{rank}.log")


def _ask_where(procs: list[Any], done: dict[int, Any]) -> None:
    """Each unfinished rank still running prints where its threads are (faulthandler, on the
    signal ``_entry`` registers): a rank past the deadline, or the silent peer of a rank that
    failed (a gloo rendezvous one side abandoned shows only as the other's lost peer)."""
    alive = [p for r, p in enumerate(procs)
             if r not in done and p.pid is not None and p.exitcode is None]  # fmt: skip
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended since
            pass
    if alive:
        time.sleep(1.0)


def _with_output(e: RankFailure, tmp: str, procs: list[Any], done: dict[int, Any]) -> RankFailure:
    """``e`` with each unfinished rank's output (stdout and stderr, ``_shorten``ed) appended,
    and the exit code of those that died: a rank killed by a signal has no traceback to
    report, and its last words (an abort's message, faulthandler's stacks) are all there is;
    one still running is asked where it waits first (``_ask_where``)."""
    _ask_where(procs, done)
    parts = [str(e)]
    for rank, p in enumerate(procs):
        if rank in done:
            continue
        try:
            text = Path(_log(tmp, rank)).read_text(errors="replace")
        except OSError:
            text = ""
        code = "" if p.exitcode is None else f", exit code {p.exitcode}"
        if not text.strip():
            if p.exitcode not in (None, 0):
                parts.append(f"--- rank {rank}{code}: printed nothing")
            continue
        parts.append(f"--- rank {rank}{code}, output:\n{_shorten(text).rstrip()}")
    return RankFailure("\n".join(parts))


LAST_WORDS = ("terminate called", "what():", "Fatal Python error", "Traceback", "Error",
              "error", "malloc", "free()", "corrupt", "Assertion", "assert")  # fmt: skip
"""Lines of a rank's output kept even from the middle of a long one: a C++ abort's message
(gloo names a collective mismatch there) and glibc's heap-corruption messages come before
faulthandler's stacks."""


def _shorten(text: str) -> str:
    """``text`` within about ``RANK_OUTPUT_CHARS`` (twice that when a rank died by a signal):
    its start, the lines between that hold ``LAST_WORDS``, and its end; a fatal signal's
    stacks (faulthandler's, from ``Fatal Python error`` on) whole but for the list of
    extension modules."""
    lines = text.splitlines()
    text = "\n".join(line for line in lines if not line.startswith("Extension modules:"))
    fatal = text.find("Fatal Python error")
    if fatal >= 0:  # what the rank printed just before the signal, then the stacks
        before = text.rfind("\n", 0, max(fatal - 1, 0))
        before = text.rfind("\n", 0, max(before, 0))  # two lines before it
        head, tail = text[: max(before, 0)], text[max(before, 0) :]
        return _shorten(head) + "\n" + tail[-2 * RANK_OUTPUT_CHARS :] if head.strip() else tail
    if len(text) <= RANK_OUTPUT_CHARS:
        return text
    head, tail = text[: RANK_OUTPUT_CHARS // 4], text[-RANK_OUTPUT_CHARS // 2 :]
    middle = text[len(head) : len(text) - len(tail)]
    kept = [line for line in middle.splitlines() if any(w in line for w in LAST_WORDS)][:20]
    gap = f"[... {len(middle)} characters, {len(kept)} lines kept ...]"
    return "\n".join([head, gap, *kept, "[...]", tail])


RANK_SERVER = "rank_server"
"""The module the fork server imports before it forks ranks (tests/rank_server.py)."""


def _context() -> Any:
    """Ranks are forked from a fork server (one per test process) that imported torch, its
    compiler stack and its distributed packages once (``RANK_SERVER``): a spawned rank spends
    about 6 s of CPU importing them, a forked one about 0.4 (moetrain's own modules). The
    server holds one thread when it
    forks, so each fork is well defined (tests/rank_server.py says why, and what an earlier
    server that held two lost); ``_entry`` checks it. ``MOETRAIN_TEST_SPAWN=1`` spawns a
    fresh interpreter per rank instead. Either way ``_entry`` sets the caller's environment,
    so a rank's does not depend on how it started."""
    if os.environ.get("MOETRAIN_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([RANK_SERVER])
    _ensure_server()
    return ctx


def _ensure_server() -> None:
    """Start the fork server unless it runs, with this directory on its ``PYTHONPATH``: the
    server imports ``RANK_SERVER`` by name from its own ``sys.path`` (Python 3.11's server
    ignores the caller's) and ignores an ImportError, which ``forked_from_one_thread`` then
    reports from the first rank."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).parent), before)))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def forked_from_one_thread() -> None:
    """In a rank forked from the fork server: raise unless the server held one thread (a
    server whose preload failed, or that started a thread, forks undefined children)."""
    server = sys.modules.get(RANK_SERVER)
    if server is None:
        raise RuntimeError(
            f"this rank was forked from a fork server that did not import {RANK_SERVER} "
            "(tests/rank_server.py): its import failed there; MOETRAIN_TEST_SPAWN=1 spawns ranks"
        )
    if server.THREADS != 1:
        raise RuntimeError(
            f"the fork server held {server.THREADS} threads when it forked this rank: a fork "
            "is defined only from one thread (tests/rank_server.py)"
        )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    init_pg: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (``_context``).

    Returns the ranks' results in rank order. ``init_pg=False`` leaves the process group to
    ``fn`` (``MASTER_ADDR``/``MASTER_PORT`` are not set; pass an ``init_method``). Raises
    ``RankFailure`` naming the first failing rank, with its traceback, or the ranks still
    running at the deadline.
    """
    ctx = _context()
    results = ctx.Queue()
    # Bytes, not tensors, in both directions: torch's pickler would move every argument
    # tensor's storage into shared memory held by a file descriptor in this process for as
    # long as the tensor lives (the cached references live for the whole session: hundreds
    # of descriptors per test, until open() fails with EMFILE).
    buf = io.BytesIO()
    torch.save(args, buf)
    args_bytes = buf.getvalue()
    with tempfile.TemporaryDirectory(prefix="moetrain-mr-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, rendezvous, fn, args_bytes, results, init_pg,
                      dict(os.environ), _log(tmp, rank), ctx.get_start_method() != "spawn"),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None and p.exitcode != 0
                    ]
                    if dead:
                        # Give a dying rank's report a moment to arrive before blaming it.
                        try:
                            rank, ok, value = results.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailure(
                                f"{fn.__name__}: rank {dead[0]} died with exit code "
                                f"{procs[dead[0]].exitcode} without a report"
                            ) from None
                    elif time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        raise RankFailure(
                            f"{fn.__name__}: ranks {missing} still running after {timeout:.0f} s"
                        ) from None
                    else:
                        continue
                if not ok:
                    raise _root_failure(fn.__name__, results, {rank: value}, procs, out)
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            for p in procs:
                p.join(timeout=30)
        except RankFailure as e:
            raise _with_output(e, tmp, procs, out) from None
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            results.close()
    return [out[r] for r in range(world_size)]
