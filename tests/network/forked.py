"""A real gloo process group on localhost for tests: :func:`run_forked` forks ``W`` processes from the test
process, joins them in a group and runs a function in each, returning every rank's result.

Forking (not spawning) reuses the parent's imports of torch and pyro_fed: a group starts in a fraction of a
second rather than the 12-22 s of fresh interpreters. The children must not rely on anything of the
parent's but its memory: each joins the group itself, and exits with :func:`os._exit` (through
:mod:`multiprocessing`), so that none of pytest's exit handlers run in it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

#: seconds the parent waits for all ranks, and each rank in a collective, by default
TIMEOUT_SECONDS = 120.0


def run_forked(
    function: Callable,
    world_size: int = 2,
    *,
    timeout_seconds: float = TIMEOUT_SECONDS,
    survivors: bool = False,
    group_timeout_seconds: float | None = None,
    **options,
) -> list:
    """``[function(rank, world_size, network) for rank in range(world_size)]``, each call in its own forked
    process, a rank of a gloo group on 127.0.0.1 with ``network`` its
    :class:`~pyro_fed.network.distributed.TorchDistributedNetwork`, from
    :func:`~pyro_fed.network.distributed.join` given the environment ``torchrun`` sets (``options`` go to
    it). Each rank waits for the others in a collective for ``group_timeout_seconds`` (by default
    ``timeout_seconds``).

    The results must be picklable; their tensors come back on the CPU. If a rank raises, or the ranks have
    not all answered after ``timeout_seconds``, the other ranks are killed and a :class:`RuntimeError`
    says which rank failed, with its traceback. With ``survivors``, a rank that dies without a result is
    reported as ``("died", exit code)`` in its place and the others are still waited for (to test what
    the survivors of a lost rank do).
    """
    context = multiprocessing.get_context("fork")
    port = _free_port()
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    processes = [
        context.Process(
            target=_child,
            args=(
                function,
                rank,
                world_size,
                port,
                group_timeout_seconds or timeout_seconds,
                options,
                pipes[rank][1],
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for _, sender in pipes:
        sender.close()  # the children's ends: a child that dies closes the last copy, and its pipe reads EOF
    results, waiting = {}, {pipes[rank][0]: rank for rank in range(world_size)}
    deadline = time.monotonic() + timeout_seconds
    try:
        while waiting:
            remaining = deadline - time.monotonic()
            ready = wait(list(waiting), timeout=max(remaining, 0.0))
            if not ready:
                raise RuntimeError(
                    f"ranks {sorted(waiting.values())} of {world_size} gave no result within "
                    f"{timeout_seconds:.0f} s (a rank waiting for the others in a collective, or too slow)."
                )
            for receiver in ready:
                rank = waiting.pop(receiver)
                try:
                    status, value = pickle.loads(receiver.recv_bytes())
                except EOFError:
                    processes[rank].join(5)
                    code = processes[rank].exitcode
                    if survivors:
                        results[rank] = ("died", code)
                        continue
                    raise RuntimeError(
                        f"rank {rank} of {world_size} died without a result (exit {code})"
                    ) from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
                results[rank] = value
    finally:
        for process in processes:
            if process.is_alive():
                process.join(0 if waiting else 10)
            if process.is_alive():
                process.kill()
                process.join()
    return [results[rank] for rank in range(world_size)]


def _child(function, rank, world_size, port, timeout_seconds, options, sender) -> None:
    from pyro_fed.network.distributed import join

    try:
        # two ranks on two cores: one thread each, rather than both fighting for both cores
        torch.set_num_threads(1)
        # TorchInductor's pool of compiling processes, if the parent started one, does not survive the fork
        # (its threads stay behind): a child compiles by itself
        from torch._inductor import config as inductor

        inductor.compile_threads = 1
        # the environment torchrun would set: the group is joined as a script run by torchrun joins it
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        network = join("gloo", timeout_seconds=timeout_seconds, **options)
        result = function(rank, world_size, network)
        # pickled here, by value: the connection's own pickler would share the tensors' memory with a
        # process that exits right after
        sender.send_bytes(pickle.dumps(("ok", _on_cpu(result))))
        dist.destroy_process_group()
    except BaseException:  # every failure goes to the parent, which reports it with its rank
        sender.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        sender.close()


def _on_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _free_port() -> int:
    # a port the system just handed out and released: free unless another process takes it meanwhile
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
