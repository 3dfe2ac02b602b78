"""Run a function on several local processes joined in a torch.distributed group.

Used by the multi-process tests and the CPU benchmarks: each process gets ``rank`` and
``world_size``, a gloo (or given) process group is initialised before the function runs and
destroyed after it, and the function's return values come back in rank order. An exception on
any rank is re-raised in the caller with that rank's traceback; a rank that hangs is killed
after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    pg_timeout_s: float,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException as err:  # report every failure, then exit non-zero
        queue.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedRunError(RuntimeError):
    """One or more ranks of :func:`spawn` failed or timed out."""


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (a module-level function) and its arguments and result picklable.

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedRunError: a rank raised (its traceback is in the message) or the run took
            longer than ``timeout`` seconds (every process is then killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, args, queue, max(30.0, timeout / 2)),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, payload = queue.get()
            (results if ok else errors)[rank] = payload
            continue
        if errors and all(not p.is_alive() or i in errors for i, p in enumerate(procs)):
            break
        if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
            # a process died without reporting (killed, segfault): give the others a moment
            time.sleep(0.5)
            if queue.empty():
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    timed_out = time.monotonic() > deadline
    for p in procs:
        p.join(timeout=5 if not errors and not timed_out else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if errors or len(results) < world_size:
        lines = [f"rank {r} failed:\n{msg}" for r, msg in sorted(errors.items())]
        missing = [r for r in range(world_size) if r not in results and r not in errors]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            why = f"timed out after {timeout:.0f} s" if timed_out else "exited without a result"
            lines.append(f"ranks {missing} {why} (exit codes {codes})")
        raise DistributedRunError("\n".join(lines))
    return [results[r] for r in range(world_size)]
