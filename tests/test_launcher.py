"""The direct launcher (``kernels/launcher.py``): a repeated launch reuses the compiled kernel
of the first, passing exactly what Triton's ``JITFunction.run`` passes; any other launch goes
through ``kernel[grid]``. A stand-in compiled kernel records the calls (no GPU here); the GPU
run (tests/test_gpu.py, tests/run_gpu.sh) runs the real launchers."""

import pytest
import torch
from triton_scaler.kernels import launch_unscale, launch_update_scale, launcher, unscale, update

from triton_scaler._plans import plan_unscale
from triton_scaler.policy import ScalePolicy


class _Compiled:
    """What ``kernel[grid](...)`` returns on a GPU: ``run`` is the compiled launcher."""

    function, packed_metadata = "function", "packed"

    def __init__(self, runs):
        self.runs = runs

    def launch_metadata(self, grid, stream, *values):
        return ("metadata", grid, stream, values)

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    arg_names = ["x_ptr", "n", "FLAG", "BLOCK"]  # a tensor, a scalar, two constexprs

    def __init__(self, compiled=True):
        self.launches, self.runs, self.compiled = [], [], compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return _Compiled(self.runs) if self.compiled else None
        return launch


_NO_KNOBS_REASON = "triton < 3.4 (no triton.knobs): the direct launcher is off"
_NO_KNOBS = pytest.mark.skipif(launcher.knobs is None, reason=_NO_KNOBS_REASON)


@pytest.fixture
def direct(monkeypatch):
    if launcher.knobs is None:
        pytest.skip(_NO_KNOBS_REASON)
    monkeypatch.setattr(launcher, "DIRECT", True)
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: 1234)
    launcher.clear()
    yield
    launcher.clear()


def _launch(kernel, x, n=5, flag=True):
    launcher.launch(kernel, 3, (x,), (n,), {"FLAG": flag, "BLOCK": 64}, {"num_warps": 4})


def _set_launch_hook(monkeypatch, hook, on_exit: bool = False) -> None:
    """``hook`` as triton's launch enter hook (exit hook: ``on_exit``) for one test: its
    ``HookChain``'s calls (triton 3.6, 3.9) replaced by a new list (the chain's own list is
    left as it is, so no hook stays behind for later launches), else the hook set."""
    hooks = launcher.knobs.runtime
    name = "launch_exit_hook" if on_exit else "launch_enter_hook"
    chain = getattr(hooks, name)
    if hasattr(chain, "calls"):
        monkeypatch.setattr(chain, "calls", [hook])
    else:
        monkeypatch.setattr(hooks, name, hook)


def test_the_direct_launcher_is_on_by_default(request):
    assert launcher.DIRECT is not request.config.getoption("--triton-launch")


@pytest.mark.parametrize("hooked", [False, True, "exit"], ids=["no_hook", "hook_set", "exit_hook"])
def test_a_repeated_launch_calls_the_compiled_launcher(direct, monkeypatch, hooked):
    """... with each tensor as its address (the launcher takes an int pointer as it is: no
    ``data_ptr`` call, no driver query). With a launch hook set (a profiler's), the hooks and
    their metadata made from the tensors themselves, as Triton's ``run`` passes them; with
    none (the default: empty hook chains), no hook and no metadata."""
    if hooked:
        _set_launch_hook(monkeypatch, lambda metadata: None, hooked == "exit")
    kernel, x = _Kernel(), torch.zeros(8)
    _launch(kernel, x)
    assert kernel.launches == [((3,), (x, 5), {"FLAG": True, "BLOCK": 64, "num_warps": 4})]
    _launch(kernel, x)
    _launch(kernel, x)
    assert len(kernel.launches) == 1
    hooks = launcher.knobs.runtime
    expected = (3, 1, 1, 1234, "function", "packed") + (
        (("metadata", (3,), 1234, (x, 5, True, 64)), hooks.launch_enter_hook,
         hooks.launch_exit_hook) if hooked else (None, None, None)) + (x.data_ptr(), 5, True, 64)
    assert len(kernel.runs) == 2 and all(type(run[9]) is int for run in kernel.runs)
    assert all(len(run) == len(expected) and all(a is b or a == b for a, b in zip(run, expected))
               for run in kernel.runs)


@_NO_KNOBS
def test_the_launcher_is_called_as_tritons_own_run_calls_it():
    """The call above is, argument for argument, how the installed triton's
    ``JITFunction.run`` calls the compiled launcher (read from its source; CI has 3.9, the GPU
    machine 3.6; the suite passes with 3.4 to 3.9): a triton that changes it fails here, not
    on a GPU."""
    import inspect

    from triton.runtime.jit import JITFunction

    source = " ".join(inspect.getsource(JITFunction.run).split())
    assert "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())" in source
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
            "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
            "*bound_args.values())") in source


def test_the_compiled_launcher_takes_int_pointers_and_no_hooks():
    """The direct call passes each tensor as its address, and None for unset launch hooks:
    the installed triton's CUDA launcher (its C source: generated in triton 3.4's and 3.6's
    ``driver.py``, ``driver.c`` in 3.9) takes an int pointer argument as it is, before any
    ``data_ptr`` call or driver query, and calls a hook only when it is not None. A triton
    that changes either fails here, not on a GPU."""
    import re
    from pathlib import Path

    import triton

    nvidia = Path(triton.__file__).parent / "backends" / "nvidia"
    sources = [path.read_text() for path in (nvidia / "driver.c", nvidia / "driver.py")
               if path.exists()]
    bodies = [match.group(1) for source in sources for match in re.finditer(
        r"(?:getPointer|extractPointer)\((?:void \*ptr, )?PyObject \*obj[^)]*\)\s*\{+(.*?)"
        r"cuPointerGetAttribute", source, re.S)]
    assert bodies, "no pointer extraction found in triton's CUDA launcher"
    for body in bodies:
        before_data_ptr = body.split("data_ptr")[0]
        assert re.search(r"if \(PyLong_Check\(obj\)\) \{+[^}]*PyLong_AsUnsignedLongLong\(obj\)"
                         r";\s*return", before_data_ptr), body[:400]
    calls = [re.findall(r"if\s*\(\s*(\w*hook) != Py_None\s*\)\s*\{+\s*(?:PyObject\s*\*\s*args = "
                        r"Py_BuildValue\([^;]*\);\s*)?PyObject\s*\*\s*ret = "
                        r"PyObject_Call(?:OneArg|Object)\(\1,", source)  # (3.4: CallObject)
             for source in sources]
    assert any(calls), "no launch hook call found in triton's CUDA launcher"


def test_a_launch_at_a_new_address_with_the_same_alignment_is_direct(direct):
    """Triton specialises a pointer on its 16-byte alignment alone: grads at new addresses
    reuse the compiled kernel, each launch passing its own address."""
    kernel, x = _Kernel(), torch.zeros(64)
    _launch(kernel, x)
    _launch(kernel, x[4:])  # 16 bytes further
    _launch(kernel, x[32:])
    assert len(kernel.launches) == 1
    assert [run[9] for run in kernel.runs] == [x[4:].data_ptr(), x[32:].data_ptr()]


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "constexpr", "device"])
def test_any_other_launch_goes_through_triton(direct, monkeypatch, change):
    kernel, x = _Kernel(), torch.zeros(8)
    _launch(kernel, x)
    if change == "alignment":
        _launch(kernel, x[1:])  # 4 bytes further: no longer 16-byte aligned
    elif change == "dtype":
        _launch(kernel, x.view(torch.int32))
    elif change == "int":
        _launch(kernel, x, n=6)
    elif change == "constexpr":
        _launch(kernel, x, flag=False)
    else:
        monkeypatch.setattr(launcher, "_current_device", lambda: 1)
        _launch(kernel, x)
    assert len(kernel.launches) == 2 and not kernel.runs


def test_hooks_that_are_none_or_empty_chains_are_no_hooks():
    assert launcher._no_hook(None) and launcher._no_hook(type("Chain", (), {"calls": []})())
    assert not launcher._no_hook(print)
    assert not launcher._no_hook(type("Chain", (), {"calls": [print]})())


def test_clear_forgets_every_launch(direct):
    kernel, x = _Kernel(), torch.zeros(8)
    _launch(kernel, x)
    _launch(kernel, x)
    launcher.clear()
    _launch(kernel, x)
    assert len(kernel.launches) == 2 and len(kernel.runs) == 1


def test_off_and_interpreted_launches_always_go_through_triton(direct, monkeypatch):
    interpreted, x = _Kernel(compiled=False), torch.zeros(8)  # no compiled kernel back
    for _ in range(3):
        _launch(interpreted, x)
    assert len(interpreted.launches) == 3
    monkeypatch.setattr(launcher, "DIRECT", False)
    kernel = _Kernel()
    for _ in range(3):
        _launch(kernel, x)
    assert len(kernel.launches) == 3 and not kernel.runs


def test_without_knobs_every_launch_goes_through_triton(monkeypatch):
    """triton < 3.4 has no ``triton.knobs`` (the launch hooks the direct call passes): the
    direct launcher stays off there, whatever ``DIRECT`` says."""
    monkeypatch.setattr(launcher, "knobs", None)
    monkeypatch.setattr(launcher, "DIRECT", True)
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    launcher.clear()
    kernel, x = _Kernel(), torch.zeros(8)
    for _ in range(3):
        _launch(kernel, x)
    assert len(kernel.launches) == 3 and not kernel.runs


def test_the_oldest_launches_are_forgotten(direct):
    kernel, x = _Kernel(), torch.zeros(64)
    for i in range(launcher._CAPACITY + 1):
        _launch(kernel, x, n=i)
    _launch(kernel, x, n=launcher._CAPACITY)  # the newest: reused
    _launch(kernel, x, n=0)  # the oldest: forgotten
    assert len(kernel.launches) == launcher._CAPACITY + 2 and len(kernel.runs) == 1


def test_the_least_recently_used_launch_is_forgotten_first(direct):
    """A launch reused every step (the update's) stays remembered while others come and go."""
    kernel, x = _Kernel(), torch.zeros(64)
    _launch(kernel, x, n=0)
    for i in range(1, 2 * launcher._CAPACITY):
        _launch(kernel, x, n=i)
        _launch(kernel, x, n=0)  # reused: the most recent again
    assert len(kernel.launches) == 2 * launcher._CAPACITY  # n=0 once, and each other n
    assert len(kernel.runs) == 2 * launcher._CAPACITY - 1  # x every other time


def test_rocm_launches_always_go_through_triton(direct, monkeypatch):
    """ROCm's specialisation also depends on each tensor's storage size, which the key leaves
    out: no launch is remembered there."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    kernel, x = _Kernel(), torch.zeros(8)
    for _ in range(3):
        _launch(kernel, x)
    assert len(kernel.launches) == 3 and not kernel.runs


def test_constexprs_out_of_order_are_refused(direct):
    with pytest.raises(ValueError, match=r"constexprs must name .*\('FLAG', 'BLOCK'\)"):
        launcher.launch(_Kernel(), 1, (torch.zeros(1),), (1,), {"BLOCK": 64, "FLAG": True}, {})


def test_every_launch_site_names_its_constexprs_in_order(monkeypatch, triton_device):
    """Each kernel launch of the package, in each of its forms, passes its constexprs in the
    kernel's order (the direct launcher passes them positionally)."""
    seen = set()

    def checked(kernel, grid, tensors, scalars, constexprs, options):
        assert all(isinstance(t, torch.Tensor) for t in tensors)
        assert not any(isinstance(s, torch.Tensor) for s in scalars)
        launcher._check_order(kernel, len(tensors) + len(scalars), constexprs)
        seen.add((kernel.__name__, *sorted(k for k, v in constexprs.items() if v is True)))
        kernel[(grid,)](*tensors, *scalars, **constexprs, **options)

    monkeypatch.setattr(unscale, "launch", checked)
    monkeypatch.setattr(update, "launch", checked)

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype, device=triton_device)

    found, scale = zeros(), zeros() + 1
    for grads in ([zeros(5) + 1], [zeros(5) + 1, zeros(3) + 1]):
        launch_unscale(plan_unscale(grads), found, scale)
        launch_unscale(plan_unscale(grads), found, scale, write=False, norm=2)
        launch_unscale(plan_unscale(grads), found, scale, clip_coef=scale, inv_from_scale=True)
    launch_update_scale(scale, zeros(dtype=torch.int32), zeros(2),
                        ScalePolicy(hysteresis=2).kernel_params(triton_device),
                        zeros(dtype=torch.int32) + 1, False, skipped=zeros(dtype=torch.bool),
                        skipped_count=zeros(dtype=torch.int64), reset_found=True)
    assert {name for name, *_ in seen} == {"unscale_kernel", "update_scale_kernel"}
    assert len(seen) >= 5


class _OnDevice:
    """Stands in for a CUDA tensor (no GPU here): only where it lives is read before launching
    (``is_cuda`` and ``get_device()``, then ``device`` to make it current)."""

    is_cuda = True

    def __init__(self, index):
        self.device = torch.device("cuda", index)

    def get_device(self):
        return self.device.index


@pytest.mark.parametrize("direct_launch", [False, True])
def test_a_launch_goes_to_the_device_of_its_first_tensor(monkeypatch, direct_launch):
    """Triton launches on the current device: grads on cuda:1 while cuda:0 is current must
    make cuda:1 current for the launch (and leave cuda:0 current after), and a launch on the
    current device must not switch."""
    current, switches = [0], []

    class _Switch:
        def __init__(self, device):
            self.index = device.index

        def __enter__(self):
            switches.append(self.index)
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", _Switch)
    monkeypatch.setattr(launcher, "DIRECT", direct_launch)
    seen = []

    class _Recording(_Kernel):
        def __getitem__(self, grid):
            seen.append(current[0])
            return lambda *args, **kwargs: None  # no compiled kernel: nothing reused

    for index in (1, 0, 1):
        _launch(_Recording(), _OnDevice(index))
    assert seen == [1, 0, 1] and switches == [1, 1] and current == [0]
