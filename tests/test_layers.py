"""The layers' boundaries, read from the source: no import cycle, internal modules import no
public module above them, ``kernels/`` imports nothing from the package (the update
kernel's parameter layout is the policy's), the unscale kernel is launched from
the dispatch layer (``triton_scaler/_dispatch.py``) alone, a private name means one thing
across the package; and, at run time, launch planning keeps what a scaler step and an ops
call reuse in one memo (rows per size pattern), and a steady-state ``unscale_`` enters at
most six of the package's files, ``clip_grad_norm_`` at most eight."""

import ast
import math
from pathlib import Path

import pytest
import torch

from triton_scaler import GradScaler, _plans, ops

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


def test_kernels_import_torch_and_triton_only():
    files = sorted((ROOT / "kernels").glob("*.py"))
    assert files
    for path in files:
        outside = {name for name in _imported_modules(path) if not name.startswith(".")
                   and name.split(".")[0] not in {"torch", "triton", "__future__", "typing",
                                                   "collections", "functools", "itertools",
                                                   "operator"}}
        assert not outside, (path.name, outside)


def test_the_update_kernels_parameter_layout_is_the_policys():
    from triton_scaler.kernels.update import PARAMS_LAYOUT

    from triton_scaler.policy import PARAMS_LAYOUT as POLICY_LAYOUT

    assert PARAMS_LAYOUT == POLICY_LAYOUT


def test_the_unscale_kernel_is_launched_from_the_dispatch_layer_alone():
    callers = set()
    for path in sorted((ROOT / "triton_scaler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "launch_unscale":
                callers.add(path.name)
    assert callers == {"_dispatch.py"}


def test_a_scaler_step_and_an_ops_call_keep_their_rows_in_the_one_memo(triton_device,
                                                                         monkeypatch):
    """A scaler's ``unscale_`` and an ops call over grads kept in place build their chunk
    tables' rows at their first calls (tensor ops), then issue no tensor op besides their
    launch (an inf planted at the end catches a stale plan); clearing planning's one memo
    makes both build them again, as at first."""
    from _launch_counting import _launches, _Ops

    _plans.clear()
    params = [torch.nn.Parameter(torch.ones(n, device=triton_device)) for n in (5, 4099, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler(triton_device.type, backend="triton")
    grads = [torch.ones(n, device=triton_device) for n in (7, 9)]
    one = torch.ones((), device=triton_device)
    issued: dict[str, list[int]] = {"unscale_": [], "ops": []}
    with _launches(monkeypatch):  # (the interpreter's work inside a launch is not counted)
        for call in range(4):
            if call == 3:
                _plans.clear()
            scaler.scale(sum(p.sum() for p in params)).backward()
            with _Ops() as mode:
                scaler.unscale_(opt)
            issued["unscale_"].append(sum(mode.ops.values()))
            assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
            found = torch.zeros((), device=triton_device)
            grads[1][-1] = math.inf if call == 2 else 1.0  # at the stored plans' end
            with _Ops() as mode:
                ops.non_finite_check_and_unscale_(grads, found, one, backend="triton")
            issued["ops"].append(sum(mode.ops.values()))
            assert found.item() == (1.0 if call == 2 else 0.0)
    for name, counts in issued.items():
        assert counts[0] > 0 and counts[1:] == [0, 0, counts[0]], (name, counts)
    _plans.clear()


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


@pytest.mark.parametrize("call, most", [("unscale_", 6), ("clip_grad_norm_", 8)])
def test_a_steady_state_call_enters_few_files(backend, call, most):
    """The fifth ``unscale_`` (``clip_grad_norm_``) over grads kept in place enters at most
    six (eight) of the package's files, leaves included (under the interpreter the kernel's
    body too): on Triton the scaler, grad collection, planning, dispatch, the kernel and its
    launcher; on the reference backend the reference path in place of the last three."""
    import sys

    params = [torch.nn.Parameter(torch.ones(n)) for n in (5, 7)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    entered: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and _ours(frame.f_code.co_filename):
            entered.add(Path(frame.f_code.co_filename).name)

    for i in range(5):
        scaler.scale(sum(p.sum() for p in params)).backward()
        if i == 4:
            sys.setprofile(profile)
        try:
            scaler.unscale_(opt) if call == "unscale_" else scaler.clip_grad_norm_(opt, 1.0)
        finally:
            sys.setprofile(None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    device_work = {"reference.py"} if backend == "reference" else \
        {"_plans.py", "unscale.py", "launcher.py"}
    assert entered <= {"grad_scaler.py", "_clip.py", "_grads.py", "_dispatch.py", *device_work}
    assert len(entered) <= most, entered


def _private_definitions(path: Path) -> dict[str, str]:
    """The module-level private names a file defines (functions, classes, assignments),
    each with its definition's source; a module's own state (a container it fills, a function,
    a class) gets its file's name too, so that it matches no other module's."""
    source = path.read_text()
    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        alias = isinstance(node, (ast.Assign, ast.AnnAssign)) and \
            isinstance(node.value, (ast.Attribute, ast.Call))
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                found[name] = (ast.get_source_segment(source, node) or "") + \
                    ("" if alias else f"  # {path}")
    return found


def test_a_private_name_means_one_thing_across_the_package():
    """Where two modules define the same private name, they define it alike (an alias of
    one torch accessor); a name never stands for two different things."""
    seen: dict[str, tuple[str, str]] = {}
    files = sorted((ROOT / "triton_scaler").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))
    for path in files:
        for name, definition in _private_definitions(path).items():
            if name in seen:
                assert seen[name][1] == definition, (name, seen[name][0], path.name)
            else:
                seen[name] = (path.name, definition)
