"""The multi-process harness of the distributed tests: spawn ranks with a bound on their
time, meet in a gloo group through a file store, run each case so that one failing case
neither hangs the other rank nor hides the other cases, and read every rank's results back."""

import datetime
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_group(rank, world_size, store_file):
    """The gloo group, met through a file store (``store_file``, see :func:`store_file_in`)
    rather than a TCP store on a port picked beforehand: a port found free by the parent can
    be taken by another test run on the machine before rank 0 listens on it (EADDRINUSE, seen
    with two suites at once). gloo's own connections take ports the OS hands out."""
    faulthandler.enable(all_threads=True)  # a rank that aborts shows where (stderr)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))


def attempt(results: dict, key, fn, *args) -> None:
    """``results[key] = fn(*args)``, or ``{"error": ...}`` when it raises (the test reports it,
    per case, and the other cases still run); then a barrier, so both ranks start the next
    case together."""
    try:
        results[key] = fn(*args)
    except Exception as error:
        results[key] = {"error": repr(error)}
    dist.barrier()


def spawned_results(cache: dict, name: str, fn, tmp_path_factory, *args, timeout_s=300,
                    world_size=2):
    """Every rank's saved results of one spawn of ``fn(rank, world_size, store_file, *args,
    out_dir)``, cached under ``name``: one spawn (seconds) serves every test that reads it."""
    if name not in cache:
        out = tmp_path_factory.mktemp(name)
        spawn_bounded(fn, (world_size, store_file_in(out), *args, str(out)), nprocs=world_size,
                      timeout_s=timeout_s)
        cache[name] = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    return cache[name]


def store_file_in(folder) -> str:
    """The rendezvous file of one spawn: in that spawn's own new temporary folder, so no two
    spawns (nor two test runs) share one, and it does not exist yet, as a file store needs."""
    return os.path.join(os.path.abspath(folder), "rendezvous")


def spawn_bounded(fn, args, *, nprocs=2, timeout_s=300):
    """Spawn ``nprocs`` ranks and join them within ``timeout_s``; kill them and fail after."""
    context = mp.start_processes(_exit_after, args=(fn, *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"distributed ranks did not finish within {timeout_s} s")


def _exit_after(rank, fn, *args):
    """Run one rank's ``fn``; once it has returned (results saved, barrier passed, group
    destroyed), leave without the interpreter's teardown. Under load, gloo's threads
    sometimes abort a rank there (``terminate called without an active exception``, the main
    thread outside any Python frame: seen once in 40 loaded runs), after the test's work is
    done. An exception in ``fn`` still exits non-zero with its traceback."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
