"""Run a function on N processes joined in a torch.distributed group: the launcher of the
distributed chapters (expert parallelism, and data, tensor and pipeline parallelism).

`run_on_ranks(function, world, *args)` starts `world` processes with torch.multiprocessing (the
"forkserver" start method: like "spawn" it works from a notebook as from a test, each rank a
fresh process that imports what its function needs, with the caller's environment as it is at
the call, but forked from a server process that imported torch once, at the first call, so the
libraries torch loads have read their variables then; a rank starts in a tenth of a second, not
two seconds of CPU), joins them through a file rendezvous in a fresh temporary folder (no port
to collide), and calls function(*args) on each, inside the group; it returns every rank's
result in rank order. An exception on any rank comes back as the same type with that rank's
message; the other ranks, left waiting in a collective, are ended by the group's timeout, so a
bad input fails and never hangs. A rank that dies without a result (a crash, a kill) is
reported within a second.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

BACKENDS = ("gloo", "nccl")
POLL_S = 0.5  # how often the parent looks for a result, or for a rank that died without one


def _worker(rank: int, world: int, backend: str, store: str, timeout_s: float, results, function, args,
            environment: dict):
    os.environ.clear()  # the caller's now, not the server's from when it started
    os.environ.update(environment)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # pickled here, by value: a tensor put on a queue as it is would be shared through a socket
        # that closes with this process
        results.put((rank, "ok", pickle.dumps(function(*args))))
    except BaseException as error:  # noqa: BLE001: every failure goes back to the parent
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _last_word_of_the_dead(processes, outcomes: dict, results):
    """None while every rank without a result is still running. A rank that ended without one
    (killed, crashed in C, or failed before its first line: a script without the
    `if __name__ == "__main__":` guard that "forkserver" needs) is reported now, not after the
    timeout; a result put just before the end is read and returned instead."""
    dead = [rank for rank, process in enumerate(processes)
            if rank not in outcomes and process.exitcode not in (None, 0)]
    if not dead:
        return None
    try:
        return results.get(timeout=POLL_S)
    except queue.Empty:
        pass
    code = processes[dead[0]].exitcode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    raise RuntimeError(f"rank {dead[0]} {how} before returning a result (its error, if any, is printed above; "
                       "a script that starts ranks needs `if __name__ == '__main__':` around its code)")


def run_on_ranks(function, world: int, *args, backend: str = "gloo", timeout_s: float = 60.0) -> list:
    """function(*args) on `world` processes in one group; each rank's result, in rank order."""
    import torch.multiprocessing as mp

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the world size must be an integer >= 1; got {world!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        # the server imports torch once for every rank of every call (torch.distributed is imported
        # in each rank: preloaded, gloo's rendezvous failed in the forked ranks)
        context.set_forkserver_preload(["torch"])
    else:  # Windows has no fork: each rank imports torch itself
        context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "rendezvous")
        processes = [context.Process(target=_worker, args=(rank, world, backend, store, timeout_s, results,
                                                             function, args, dict(os.environ)), daemon=True)
                     for rank in range(world)]
        for process in processes:
            process.start()
        outcomes = {}
        deadline = time.monotonic() + timeout_s + 30
        try:
            while len(outcomes) < world:
                try:
                    got = results.get(timeout=POLL_S)
                except queue.Empty:
                    got = _last_word_of_the_dead(processes, outcomes, results)
                if got is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no result from ranks {sorted(set(range(world)) - set(outcomes))} "
                                           f"within {timeout_s + 30:g} s")
                    continue
                rank, status, value = got
                outcomes[rank] = (status, value)
                if status == "error":  # the first failure: the others may be stuck in a collective
                    break
        finally:
            for process in processes:
                process.join(timeout=5 if len(outcomes) == world else 0.5)
                if process.is_alive():
                    process.terminate()
                    process.join()
    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    if errors:
        rank = min(errors)
        name, message, trace = errors[rank]
        kind = {"ValueError": ValueError, "TypeError": TypeError}.get(name, RuntimeError)
        raise kind(message if kind is not RuntimeError else f"rank {rank} failed: {name}: {message}\n{trace}")
    return [pickle.loads(outcomes[rank][1]) for rank in range(world)]
