"""The layers' boundaries, read from the source: no import cycle, internal modules import no
public module above them, ``kernels/`` imports nothing from the package but the description
of its arguments (``triton_scaler/_kernel_args.py``), the unscale kernel is launched from
the dispatch layer (``triton_scaler/_dispatch.py``) alone, and launch planning keeps what it reuses in
one bounded store, which a scaler step and an ops call both fill; and, traced at run time, a
steady-state ``unscale_`` calls down through at most six files."""

import ast
from pathlib import Path

import torch

from triton_scaler import GradScaler, _plan_store, ops

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative ones as ``.name``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_kernels_import_only_the_description_of_their_arguments():
    files = sorted((ROOT / "kernels").glob("*.py"))
    assert files
    for path in files:
        from_package = {name for name in _imported_modules(path)
                        if name.startswith("triton_scaler")}
        assert from_package <= {"triton_scaler._kernel_args"}, (path.name, from_package)


def test_the_unscale_kernel_is_launched_from_the_dispatch_layer_alone():
    callers = set()
    for path in sorted((ROOT / "triton_scaler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "launch_unscale":
                callers.add(path.name)
    assert callers == {"_dispatch.py"}


def test_a_scaler_step_and_an_ops_call_keep_their_plans_in_the_one_store(
        monkeypatch, triton_device):
    """Their launches, the chunk table and its size pattern are entries of one store, which
    never holds more than its capacity of each kind (here 3: the oldest entries go)."""
    _plan_store.clear()
    params = [torch.nn.Parameter(torch.ones(n, device=triton_device)) for n in (5, 4099, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler(triton_device.type, backend="triton")
    for _ in range(2):
        scaler.scale(sum(p.sum() for p in params)).backward()
        scaler.step(opt)
        scaler.update()
    found = torch.zeros((), device=triton_device)
    ops.non_finite_check_and_unscale_([torch.ones(7, device=triton_device),
                                       torch.ones(9, device=triton_device)], found,
                                      torch.ones((), device=triton_device), backend="triton")
    kinds = {kind: _plan_store.count(kind) for kind in ("grads", "ops", "table", "sizes")}
    assert kinds == {"grads": 1, "ops": 1, "table": 2, "sizes": 2}
    monkeypatch.setattr(_plan_store, "CAPACITY", 3)
    for i in range(4):
        _plan_store.keep(("table", i), i)
    assert _plan_store.count("table") == 3 and _plan_store.lookup(("table", 0)) is None
    assert _plan_store.count("grads") == 1
    _plan_store.clear()



def _package_imports() -> dict[str, set[str]]:
    """Each module of the package (and ``kernels/``, as ``kernels.<name>``) with the package
    modules it imports anywhere in its source: lazy, function-local and type-checking
    imports included."""
    files = {f"{path.stem}": path for path in (ROOT / "triton_scaler").glob("*.py")}
    files.update({f"compat.{p.stem}": p for p in (ROOT / "triton_scaler" / "compat").glob("*.py")})
    files.update({f"kernels.{p.stem}": p for p in (ROOT / "kernels").glob("*.py")})
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.rsplit(".", 1)[0] if "." in name else ""
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1:
                    base = f"{package}.{base}".strip(".") if package else base
                elif node.level == 2:
                    pass  # from the package root (compat -> triton_scaler)
                elif base.startswith("triton_scaler."):
                    base = base[len("triton_scaler."):]
                elif base == "triton_scaler":
                    base = ""
                else:
                    continue
                targets = [base] if base else []
                targets += [f"{base}.{a.name}".strip(".") for a in node.names]
                found.update(t for t in targets if t in files and t != name)
        graph[name] = found
    return graph


def test_no_module_of_the_package_takes_part_in_an_import_cycle():
    graph = _package_imports()
    state: dict[str, int] = {}

    def visit(name, path):
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_internal_modules_import_no_public_module_above_them():
    """The scaler's internals sit below the public face: no ``_``-module imports
    ``grad_scaler``, ``ops``, ``buckets``, ``sharded``, ``schedulers``, ``integrations`` or the
    adapters."""
    public = {"grad_scaler", "ops", "buckets", "sharded", "schedulers", "integrations",
              "diagnostics", "demo", "bench"}
    for name, imported in _package_imports().items():
        if (name.startswith("_") and not name.startswith("__")) or name.startswith("kernels."):
            assert not (imported & public), (name, imported & public)


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return (ROOT / "triton_scaler") in path.parents or (ROOT / "kernels") in path.parents


def test_a_steady_state_unscale_passes_through_at_most_six_files(backend):
    """The fifth ``unscale_`` over grads kept in place calls down through at most six of the
    package's files: those whose code calls into another of them (the scaler's entry, the
    scaler, grad collection, dispatch, and on Triton the kernel's launch helper), then the one
    doing the device work (the reference path, or the launcher). Leaf lookups that return at
    once (the scaler's state, planning's store) are not passed through."""
    import sys

    params = [torch.nn.Parameter(torch.ones(n)) for n in (5, 7)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    through: set[str] = set()

    def profile(frame, event, arg):
        caller = frame.f_back
        if event == "call" and caller is not None and _ours(frame.f_code.co_filename) and \
                _ours(caller.f_code.co_filename) and \
                caller.f_code.co_filename != frame.f_code.co_filename:
            through.add(Path(caller.f_code.co_filename).name)

    for i in range(5):
        scaler.scale(sum(p.sum() for p in params)).backward()
        if i == 4:
            sys.setprofile(profile)
        try:
            scaler.unscale_(opt)
        finally:
            sys.setprofile(None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    device_work = "reference.py" if backend == "reference" else "launcher.py"
    assert through | {device_work} <= {"_compile.py", "grad_scaler.py", "_grads.py",
                                       "_dispatch.py", "unscale.py", device_work}
    assert len(through | {device_work}) <= 6, through
