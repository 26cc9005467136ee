"""Which backend the ops run on: the accepted names, ``"auto"`` on CPU, a clear error when
Triton cannot run, and ``"reference"`` as torch alone (never the Triton kernels)."""

import math

import pytest
import torch
from _util import assert_all_same

from triton_scaler import ops


@pytest.mark.parametrize("bad, error, match", [
    ("fast", ValueError, "backend must be one of 'auto', 'reference', 'triton'"),
    (None, ValueError, "backend must be one of"),
])
def test_bad_backend(bad, error, match):
    with pytest.raises(error, match=match):
        ops.non_finite_check_and_unscale_([torch.ones(2)], torch.zeros(()), torch.ones(()),
                                          backend=bad)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from triton_scaler.kernels import unscale

    monkeypatch.setattr(unscale, "is_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="backend='triton' runs on CUDA tensors"):
        ops.non_finite_check_and_unscale_([torch.ones(2)], torch.zeros(()), torch.ones(()),
                                          backend="triton")


def test_triton_without_the_triton_package_is_a_clear_error(monkeypatch):
    """Without triton installed, ``"triton"`` names the package and the way out; ``"auto"``
    takes the reference path."""
    from triton_scaler import _backend

    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    grads = [torch.ones(2)]
    with pytest.raises(RuntimeError, match="backend='triton' needs the 'triton' package"):
        ops.non_finite_check_and_unscale_(grads, torch.zeros(()), torch.ones(()),
                                          backend="triton")
    assert _backend.resolve_backend("auto", torch.device("cuda")) == "reference"
    ops.non_finite_check_and_unscale_(grads, torch.zeros(()), torch.full((), 0.5))
    assert grads[0].tolist() == [0.5, 0.5]


def test_auto_picks_reference_on_cpu(monkeypatch):
    from triton_scaler import reference

    calls = []
    monkeypatch.setattr(reference, "non_finite_check_and_unscale_",
                        lambda *a: calls.append(a))
    ops.non_finite_check_and_unscale_([torch.ones(2)], torch.zeros(()), torch.ones(()))
    assert len(calls) == 1


def test_the_reference_backend_never_reaches_triton(monkeypatch):
    """``backend="reference"`` is torch alone: no op asks for the Triton kernels (on CPU the
    interpreter would give the same bits, so only this tells the two apart), and the results
    are torch's."""
    from triton_scaler import _backend, _dispatch, _plans

    def refused():
        raise AssertionError("the reference backend asked for the Triton kernels")

    for module in (_backend, _dispatch, _plans):
        monkeypatch.setattr(module, "triton_kernels", refused)
    grads = [torch.tensor([1.0, -math.inf, 3.0]), torch.ones(5, dtype=torch.float16)[::2]]
    expected = [g.clone() for g in grads]
    found, checked, found_expected = torch.zeros(()), torch.zeros(()), torch.zeros(())
    inv = torch.full((), 0.25)
    ops.non_finite_check_(grads, checked, inv, backend="reference")
    assert_all_same(grads, expected)
    ops.non_finite_check_and_unscale_(grads, found, inv, backend="reference")
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected, inv)
    assert_all_same([*grads, found, checked], [*expected, found_expected, found_expected])
    assert not ops.all_finite(grads, backend="reference").item()
    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    ops.update_scale_(scale, tracker, found, 2.0, 0.5, 3, backend="reference")
    assert scale.item() == 4.0


@pytest.mark.parametrize("interpreting", [False, True])
def test_the_choice_for_cuda_tensors(monkeypatch, interpreting):
    """Decided without a GPU (a ``torch.device("cuda")`` needs none): ``"auto"`` and
    ``"triton"`` take the kernels for CUDA tensors whether or not the interpreter is on,
    ``"reference"`` never does; ``"triton"`` on CPU tensors only under the interpreter."""
    from triton_scaler import _backend

    monkeypatch.setattr(_backend, "triton_interpreting", lambda: interpreting)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [_backend.resolve_backend(b, cuda) for b in ("auto", "triton", "reference")] == \
        ["triton", "triton", "reference"]
    assert [_backend.resolve_backend(b, cpu) for b in ("auto", "reference")] == \
        ["reference", "reference"]
    if interpreting:
        assert _backend.resolve_backend("triton", cpu) == "triton"
    else:
        with pytest.raises(RuntimeError, match="backend='triton' runs on CUDA tensors"):
            _backend.resolve_backend("triton", cpu)
