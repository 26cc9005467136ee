"""A grad whose own elements share memory (``as_strided`` with overlapping strides,
``expand``): torch's op multiplies such memory once per element that refers to it (and
raises for an expanded one); the Triton backend unscales non-dense grads through contiguous
copies written back, which would multiply each location once. The reference path is
torch's op. The Triton backend refuses to write such grads, before any grad changes, and
reads them in a check. (Two grads sharing part of their memory:
test_grads_sharing_memory.py.)"""

import itertools
import math

import pytest
import torch
from _util import assert_all_same, assert_same

from triton_scaler import GradScaler, all_finite, ops
from triton_scaler._memory import overlaps as _overlaps

OVERLAP = "more than one element of a gradient refers to a single memory location"
SHARED = "two gradients share part of their memory"


def _brute_force_overlaps(shape, strides) -> bool:
    offsets = [sum(i * st for i, st in zip(index, strides))
               for index in itertools.product(*(range(n) for n in shape))]
    return len(set(offsets)) < len(offsets)


@pytest.mark.parametrize("dims, largest_size, largest_stride, each_answer_at_least", [
    ((1, 2, 3), 3, 5, 1000),  # 6,174 layouts
    # a dimension's reach is stride * (size - 1), which the sizes and strides above cannot
    # tell from stride + size - 1: (2, 5) with strides (10, 5) overlaps (10 = 5 * 2)
    ((2,), 5, 10, 500),  # 3,025 layouts
], ids=["up-to-3-D", "2-D-larger"])
def test_the_overlap_test_agrees_with_every_offset_counted(dims, largest_size, largest_stride,
                                                           each_answer_at_least):
    """Every layout of these dimensions, sizes and strides (from 1 and 0), against the
    offsets counted one by one."""
    seen = {True: 0, False: 0}
    for n in dims:
        for shape in itertools.product(range(1, largest_size + 1), repeat=n):
            for strides in itertools.product(range(largest_stride + 1), repeat=n):
                expected = _brute_force_overlaps(shape, strides)
                assert _overlaps(shape, strides) == expected, (shape, strides)
                seen[expected] += 1
    assert min(seen.values()) > each_answer_at_least  # both answers exercised


def _overlapping(fill: float = 4.0, dtype=torch.float32, device="cpu"):
    """A (3, 3) grad over 5 elements of a 6-element buffer (strides (1, 1)), and the buffer."""
    base = torch.full((6,), fill, dtype=dtype, device=device)
    return base.as_strided((3, 3), (1, 1)), base


@pytest.mark.parametrize("where", ["alone", "first", "last", "beside_another_dtype"])
def test_ops_triton_refuses_to_write_it_and_changes_nothing(triton_device, where):
    grad, base = _overlapping(device=triton_device)
    same = torch.full((7,), 4.0, device=triton_device)
    other = torch.full((5,), 4.0, dtype=torch.float64, device=triton_device)
    grads = {"alone": [grad], "first": [grad, same], "last": [same, grad],
             "beside_another_dtype": [other, grad]}[where]
    snapshot = [g.clone() for g in (base, same, other)]
    found = torch.zeros((), device=triton_device)
    with pytest.raises(RuntimeError, match=OVERLAP + r" \(shape \(3, 3\), strides \(1, 1\)\)"):
        ops.non_finite_check_and_unscale_(grads, found, torch.full((), 0.5, device=found.device),
                                          backend="triton")
    assert_all_same([base, same, other], snapshot)
    assert found.item() == 0.0


@pytest.mark.parametrize("kind", ["own_elements", "two_grads"])
def test_the_kernels_launcher_itself_refuses_to_write_it(triton_device, kind):
    """``launch_unscale`` (kernels/unscale.py) refuses a write over such a plan on its own,
    not only behind the ops' check, before any grad changes; its read-only check reads the
    same grads."""
    from triton_scaler.kernels.unscale import launch_unscale as launch

    from triton_scaler._plans import plan_unscale

    grad, base = _overlapping(device=triton_device)
    buffer = torch.full((9,), 4.0, device=triton_device)
    grads = [grad, buffer[:3]] if kind == "own_elements" else [buffer[:6], buffer[2:]]
    snapshot = [base.clone(), buffer.clone()]
    inv = torch.full((), 0.5, device=triton_device)
    found = torch.zeros((), device=triton_device)
    with pytest.raises(RuntimeError, match=OVERLAP if kind == "own_elements" else SHARED):
        launch(plan_unscale(grads), found, inv)
    assert_all_same([base, buffer], snapshot)
    grads[-1][-1] = math.inf  # the last element of the last grad
    planted = buffer.clone()
    launch(plan_unscale(grads), found, inv, write=False)
    assert found.item() == 1.0
    assert_all_same([base, buffer], [snapshot[0], planted])


def test_ops_reference_is_torchs_op():
    grad, base = _overlapping()
    theirs, their_base = _overlapping()
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], torch.zeros(()),
                                                     torch.full((), 0.5))
    ops.non_finite_check_and_unscale_([grad], torch.zeros(()), torch.full((), 0.5),
                                      backend="reference")
    assert_same(base, their_base)
    assert not torch.equal(their_base, torch.full((6,), 2.0))  # torch's is not "once each"


def test_the_read_only_check_reads_it(backend):
    grad, base = _overlapping()
    assert all_finite([grad, torch.ones(1).expand(5)], backend=backend).item()
    base[4] = math.inf  # reached only through the last element of the (3, 3) view
    found = torch.zeros(())
    ops.non_finite_check_([torch.ones(3), grad], found, torch.ones(()), backend=backend)
    assert found.item() == 1.0 and base[:4].eq(4.0).all()


def test_an_expanded_grad_raises_on_both_backends(backend):
    """torch's op raises for it (its stride 0); the Triton backend names it the same way."""
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(1).expand(5)], torch.zeros(()), torch.ones(()))
    match = OVERLAP if backend == "triton" else "more than one element of the written-to"
    with pytest.raises(RuntimeError, match=match):
        ops.non_finite_check_and_unscale_([torch.ones(1).expand(5)], torch.zeros(()),
                                          torch.ones(()), backend=backend)


def test_a_gapped_grad_that_does_not_overlap_is_still_unscaled(backend):
    """Every other element of a buffer, transposed: not dense, no overlap: as torch's op."""
    gen = torch.Generator().manual_seed(0)
    ours = torch.randn(6, 10, generator=gen) * 1000
    theirs = ours.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([theirs[:, ::2].t()], torch.zeros(()),
                                                     torch.full((), 1 / 3))
    ops.non_finite_check_and_unscale_([ours[:, ::2].t()], torch.zeros(()),
                                      torch.full((), 1 / 3), backend=backend)
    assert_same(ours, theirs)


def _scaler_setup(backend):
    """Two groups (float64 first, then float32 with the overlapping grad), scaled by 2."""
    grad, base = _overlapping()
    p = torch.nn.Parameter(torch.zeros(3, 3))
    q = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    q.grad, p.grad = torch.full((4,), 4.0, dtype=torch.float64), grad
    opt = torch.optim.SGD([q, p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0) if backend == "torch" else \
        GradScaler("cpu", init_scale=2.0, backend=backend)
    scaler.scale(torch.ones(()))
    return scaler, opt, base, p, q


@pytest.mark.parametrize("call", ["unscale_", "step", "clip_grad_norm_"])
def test_grad_scaler_reference_is_torchs_and_triton_refuses_before_any_change(backend, call):
    theirs = _scaler_setup("torch")
    ours = _scaler_setup(backend)
    calls = {"unscale_": lambda s, o: s.unscale_(o), "step": lambda s, o: s.step(o),
             "clip_grad_norm_": lambda s, o: s.clip_grad_norm_(o, 1e6)}
    if backend == "reference":
        scaler, opt = theirs[:2]
        if call == "clip_grad_norm_":  # torch's route: unscale_, then the clip
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1e6)
        else:
            calls[call](scaler, opt)
        calls[call](*ours[:2])
        for mine, their in zip(ours[2:], theirs[2:]):
            assert_same(mine.detach(), their.detach())
        return
    scaler, opt, base, p, q = ours
    with pytest.raises(RuntimeError, match=OVERLAP):
        calls[call](scaler, opt)
    assert_same(base, torch.full((6,), 4.0))  # nothing unscaled: neither group
    assert_same(q.grad, torch.full((4,), 4.0, dtype=torch.float64))
    assert_same(p.detach(), torch.zeros(3, 3))
    p.grad = torch.full((3, 3), 4.0)  # the user's way out: a grad of its own memory
    scaler.step(opt)
    scaler.update()
    assert_same(p.detach(), torch.full((3, 3), -2.0))
    assert_same(q.detach(), torch.full((4,), -2.0, dtype=torch.float64))


@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_read_only_check_reads_it_as_torchs(backend, overflow):
    """The integrators' ``_check_inf_per_device`` (the fused optimizers' read-only check)
    writes no grad: the overlapping grad beside another group is read, not refused, and an
    inf reached only through its last element is found, as torch's; ``update()`` after it.
    (torch's fused CPU optimizers read such a grad as if it were contiguous: no step here.)"""
    results = []
    for which in ("torch", backend):
        scaler, opt, base, _, q = _scaler_setup(which)
        if overflow:
            base[4] = math.inf
        found = [t.item() for t in scaler._check_inf_per_device(opt).values()]
        scaler.update()
        results.append((found, base, q.grad, scaler._scale))
    (their_found, *theirs), (found, *ours) = results
    assert found == their_found == [float(overflow)]
    for mine, their in zip(ours, theirs):
        assert_same(mine, their)
    assert theirs[2].item() == (1.0 if overflow else 2.0)
