"""Run a function on several local processes joined in a torch.distributed group.

Used by the multi-process tests and the CPU benchmarks: each process gets ``rank`` and
``world_size``, a gloo (or given) process group is initialised before the function runs and
destroyed after it, and the function's return values come back in rank order. An exception on
any rank is re-raised in the caller with that rank's traceback; a rank that hangs is killed
after ``timeout`` seconds.

The processes start from a fork server that has imported torch, transformers, Lightning and
this package once (``multiprocessing``'s ``"forkserver"`` start method with those modules
preloaded), so each process skips the imports that a ``"spawn"`` start repeats: a few seconds per
process on an idle machine, and most of a multi-process test's set-up on a busy one. Nothing of
the caller's state reaches the processes but the pickled function and arguments, as with
``"spawn"`` (the environment is the caller's at the call, not the fork server's); the fork
server runs no torch operation before it forks, so no thread pool is copied. Where a platform has no fork server (Windows), ``"spawn"`` is used.
"""

from __future__ import annotations

import multiprocessing
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

PRELOADED = ("torch", "torch.distributed", "transformers", "lightning.pytorch", "lightning_skrull")
"""What the fork server imports once, before it forks the processes of :func:`spawn`."""


def _context(start_method: str) -> Any:
    """The multiprocessing context of ``start_method`` (``"forkserver"``: with
    :data:`PRELOADED` imported in the fork server; ``"spawn"`` where there is no fork server)."""
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"  # pragma: no cover - Windows
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # takes effect when the fork server starts (the first spawn of this process)
        ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


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
    environ: dict[str, str],
) -> None:
    # the caller's environment now (a fork server's children inherit the server's, from its
    # start), as a spawned process would
    os.environ.clear()
    os.environ.update(environ)
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
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (a module-level function) and its arguments and result picklable.

    Args:
        fn: run on every process as ``fn(rank, world_size, *args)``, in an initialised process
            group.
        world_size: number of processes.
        args: further arguments of ``fn``.
        backend: the process group's backend.
        timeout: seconds before every process is killed.
        start_method: ``"forkserver"`` (the modules in :data:`PRELOADED` imported once) or
            ``"spawn"`` (every process imports everything itself).

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedRunError: a rank raised (its traceback is in the message) or the run took
            longer than ``timeout`` seconds (every process is then killed).
        ValueError: ``world_size < 1`` or another ``start_method``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"start_method must be 'forkserver' or 'spawn', got {start_method!r} ('fork' would "
            "copy the caller's torch state, thread pools included, into every process)."
        )
    ctx = _context(start_method)
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                backend,
                fn,
                args,
                queue,
                max(30.0, timeout / 2),
                dict(os.environ),
            ),
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
