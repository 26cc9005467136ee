"""Launching a compiled kernel again without Triton's per-call binder. ``kernel[grid](*args)``
works out on every call what its arguments specialise (each pointer's and integer's
16-divisibility, dtypes, constexprs), builds and hashes a cache key, checks the kernel's
globals and only then calls the compiled kernel's launcher: host microseconds per launch,
which a scaler pays every step. :func:`launch` remembers the compiled kernel of a launch by
what decides its specialisation, the current device and every argument (each tensor's dtype
and address modulo 16, the alignment Triton specialises a pointer on; every other value as it
is), and when such arguments come again (a training loop's steady state, grads at new
addresses included) calls that compiled kernel's launcher itself, as ``JITFunction.run`` ends
(triton 3.4 to 3.9): ``kernel.run(grid..., stream, kernel.function, kernel.packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)``, but with each tensor argument given as its
address (already read for the key), which the compiled launcher takes as it is: no
``data_ptr`` call and no ``cuPointerGetAttribute`` per tensor (as triton 3.6's to 3.9's
launchers take them); and the launch hooks and their metadata (made from the tensors, as
Triton makes it) passed only when a hook is set, not Triton's empty hook chains and a dict per
launch. Any other launch goes through ``kernel[grid]``.

Limits: Triton's ``pre_run_hooks`` do not run on the direct path, and knobs that change
compilation (``knobs.runtime.debug``, instrumentation) are not watched: call :func:`clear`
after changing them. Under the interpreter ``kernel[grid]`` returns no compiled kernel, and
on ROCm a kernel's specialisation also depends on each tensor's storage size, which the key
leaves out: there every launch goes through ``kernel[grid]``, as with triton older than 3.4
(no ``triton.knobs``). ``DIRECT = False`` sends every launch through ``kernel[grid]``;
``tests/run_gpu.sh`` runs the kernel tests both ways. The direct path's saving is measured
by ``benchmarks/gpu_figures.py``'s ``launch`` row (``benchmarks/RESULTS.md``).

Every launch goes to the CUDA device of its first tensor: Triton launches on the *current*
device and its current stream, not on the device of the pointers it is given, so grads on
``cuda:1`` while ``cuda:0`` is current would be read through the wrong device's context.
:func:`launch` makes that device current for the launch when it is not (no CUDA call for the
interpreter's CPU tensors); the stream is then that device's current stream, the one torch's
own ops would use.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict

import torch
from triton.runtime import driver

try:
    from triton import knobs  # triton >= 3.4: the launch hooks the direct path passes
except ImportError:
    knobs = None

#: Use the compiled kernels' launchers directly for repeated launches (see the module doc).
DIRECT = True

_CAPACITY = 16  # remembered launches per kernel (a step has a few: buckets, groups, update)

_compiled: dict[object, OrderedDict] = {}


def launch(kernel, grid: int, tensors: tuple, scalars: tuple, constexprs: dict,
           options: dict) -> None:
    """``kernel[(grid,)](*tensors, *scalars, **constexprs, **options)`` on the device of
    ``tensors[0]``: the kernel's parameters are its tensors, then its other runtime values,
    then its constexprs (passed by name, in the kernel's order). ``options`` (``num_warps``,
    ...) are not part of what is remembered: for one kernel they must follow from its
    constexprs (unscale's 16 warps from ``FP64=True``). Asynchronous, as ``kernel[grid]``."""
    first = tensors[0]
    if first.is_cuda and first.get_device() != torch.cuda.current_device():
        with torch.cuda.device(first.device):  # now current: the launch below runs there
            return launch(kernel, grid, tensors, scalars, constexprs, options)
    if not DIRECT:
        kernel[(grid,)](*tensors, *scalars, **constexprs, **options)
        return
    cache = _compiled.get(kernel)  # none yet, or never (the interpreter compiles nothing)
    key = None
    if cache is not None:
        device = _current_device()
        addresses = tuple(map(_DATA_PTR, tensors))
        key = _launch_key(device, addresses, tensors, scalars, constexprs)
        compiled = cache.get(key)
        if compiled is not None:
            try:
                cache.move_to_end(key)  # the least recently used launches are dropped first
            except KeyError:  # dropped by another thread since the read: still callable
                pass
            _run(compiled, grid, _current_stream(device), tensors, addresses,
                 (*scalars, *constexprs.values()))
            return
    compiled = kernel[(grid,)](*tensors, *scalars, **constexprs, **options)
    if _reusable(compiled):
        if cache is None:
            _check_order(kernel, len(tensors) + len(scalars), constexprs)
            cache = _compiled[kernel] = OrderedDict()
            key = _launch_key(_current_device(), tuple(map(_DATA_PTR, tensors)), tensors,
                              scalars, constexprs)
        _remember(cache, key, compiled)


def _remember(cache: OrderedDict, key: tuple | None, compiled) -> None:
    """Keep ``compiled`` under ``key``, dropping the least recently used launches beyond
    ``_CAPACITY`` (a loop's few launches all fit). Safe when another thread changes
    the cache meanwhile (a lost entry is a later ``kernel[grid]``, not an error)."""
    cache[key] = compiled
    while len(cache) > _CAPACITY:
        try:
            cache.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break


def _reusable(compiled) -> bool:
    """A compiled kernel (not the interpreter's None) of a backend whose specialisation
    :func:`_launch_key` covers: CUDA's (pointer alignment; ROCm's also depends on storage
    sizes)."""
    return torch.version.hip is None and knobs is not None and all(
        hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_FIFTEEN = itertools.repeat(15)  # endless: one object for every key


def _launch_key(device: int, addresses: tuple[int, ...], tensors: tuple, scalars: tuple,
                constexprs: dict) -> tuple:
    """All that decides a launch's specialisation: the device, each tensor's address modulo
    16 (Triton specialises a pointer on its 16-byte alignment alone, so grads at new
    addresses launch as before) and dtype, every other argument as it is (C-level passes)."""
    return (device, *scalars, *constexprs.values(), *map(operator.and_, addresses, _FIFTEEN),
            *map(_DTYPE, tensors))


def _current_device() -> int:
    return driver.active.get_current_device()


def _current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def _check_order(kernel, n_args: int, constexprs: dict) -> None:
    """The launcher takes every parameter positionally: ``constexprs`` must name the
    kernel's parameters after the first ``n_args``, in its order."""
    rest = tuple(kernel.arg_names[n_args:])
    if tuple(constexprs) != rest:
        raise ValueError(f"constexprs must name the parameters of {kernel} after the first "
                         f"{n_args}, in its order: {rest}; got {tuple(constexprs)}")


def _run(compiled, grid: int, stream, tensors: tuple, addresses: tuple[int, ...],
         rest: tuple) -> None:
    """What ``JITFunction.run`` does once it has its compiled kernel (triton 3.4 to 3.9),
    with each tensor argument passed to the compiled launcher as its address (``addresses``,
    read for the key): for an int pointer argument the launcher neither calls ``data_ptr``
    nor asks the driver about the pointer (``cuPointerGetAttribute``), one Python call and
    one driver call fewer per tensor. Launch hooks (``knobs.runtime.launch_enter_hook`` /
    ``launch_exit_hook``, e.g. a profiler's) are passed, with metadata made from the tensors
    as Triton makes it, only when one is set: with none the launcher has nothing to call
    (``rest``: the other arguments, in the kernel's order)."""
    hooks = knobs.runtime
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    if _no_hook(enter) and _no_hook(leave):  # the launcher then calls none, and no metadata
        metadata = enter = leave = None
    else:
        metadata = compiled.launch_metadata((grid,), stream, *tensors, *rest)
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                 enter, leave, *addresses, *rest)


def _no_hook(hook) -> bool:
    """A launch hook that does nothing: None, or an empty ``HookChain`` (triton 3.6 and 3.9's
    default), which Triton's own ``run`` still hands the launcher to call, with metadata made
    for it (a dict per launch)."""
    return hook is None or getattr(hook, "calls", None) == []


def clear() -> None:
    """Forget every remembered launch (the next launch of each goes through ``kernel[grid]``)."""
    _compiled.clear()
