"""Run a function on N real processes (gloo on CPU) and bring back what each rank returned.

A rank that fails, or a job that cannot start or finish in time, fails the test with that rank's
traceback: a multi-rank test never passes without its ranks having run.

Ranks are forked from a server process that has imported torch, dynshard and transformers once (the
"forkserver" start method, its modules preloaded): a rank starts in about 0.05 s where a fresh interpreter
takes 3.5 s on two cores, most of a short test. Nothing but imports runs in the server, so a rank starts
from the state a fresh interpreter has after those imports. A job given its own environment (``env``)
starts fresh interpreters instead, since torch reads some variables when it is imported.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "dynshard", "transformers"]
mp.set_forkserver_preload(PRELOADED)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "OMP_NUM_THREADS": "1", **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600, env: dict | None = None) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their return values."""
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(_entry, args=(world_size, _free_port(), outdir, fn, args, env or {}),
                                     nprocs=world_size, join=False, start_method="spawn" if env else "forkserver")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world_size}-rank job did not finish in {timeout}s")
        except mp.ProcessRaisedException as error:
            errors = [open(os.path.join(outdir, name)).read() for name in sorted(os.listdir(outdir))
                      if name.endswith(".err")]
            raise AssertionError("a rank failed:\n" + ("\n".join(errors) or str(error))) from None
        except mp.ProcessExitedException as error:
            raise AssertionError(f"a rank died: {error}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} returned nothing")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
