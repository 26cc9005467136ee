"""Grads that share memory in ways torch's op gives a result the Triton kernels cannot:

* a grad whose own elements share memory (``as_strided`` with overlapping strides,
  ``expand``): torch's op multiplies such memory once per element that refers to it (and
  raises for an expanded one); the Triton backend unscales non-dense grads through
  contiguous copies written back, which would multiply each location once;
* two grads that share part of their memory (one starts inside another): torch's op
  multiplies it once per grad; the kernel's programs run in no fixed order on a GPU.

The reference path is torch's op. The Triton backend refuses to write such grads, before any
grad changes, and reads them in a check. (Grads that start at the same address are unscaled
once on both backends, on purpose: README, "Exactness".)"""

import itertools
import math

import pytest
import torch
from _util import assert_all_same, assert_same
from triton_scaler.kernels.plan import _ranges_overlap

from triton_scaler import GradScaler, all_finite, ops
from triton_scaler._memory import _offsets, share_elements
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
    """``launch_unscale`` (kernels/unscale.py) refuses a write on its own, not only behind
    the ops' check, before any grad changes; its read-only check reads the same grads."""
    from triton_scaler.kernels.unscale import launch_unscale

    grad, base = _overlapping(device=triton_device)
    buffer = torch.full((9,), 4.0, device=triton_device)
    grads = [grad, buffer[:3]] if kind == "own_elements" else [buffer[:6], buffer[2:]]
    snapshot = [base.clone(), buffer.clone()]
    inv = torch.full((), 0.5, device=triton_device)
    found = torch.zeros((), device=triton_device)
    with pytest.raises(RuntimeError, match=OVERLAP if kind == "own_elements" else SHARED):
        launch_unscale(grads, found, inv)
    assert_all_same([base, buffer], snapshot)
    grads[-1][-1] = math.inf  # the last element of the last grad
    planted = buffer.clone()
    launch_unscale(grads, found, inv, write=False)
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


def test_the_range_test_agrees_with_every_pair_compared():
    gen = torch.Generator().manual_seed(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        n = int(torch.randint(1, 6, (), generator=gen))
        starts = torch.randperm(40, generator=gen)[:n]
        lengths = torch.randint(1, 9, (n,), generator=gen)
        expected = any(a < c + d and c < a + b for i, (a, b) in enumerate(
            zip(starts.tolist(), lengths.tolist())) for c, d in list(zip(
                starts.tolist(), lengths.tolist()))[i + 1:])
        assert _ranges_overlap(starts, lengths) == expected, (starts, lengths)
        seen[expected] += 1
    assert min(seen.values()) > 50


def _sharing(buf: torch.Tensor, kind: str) -> list[torch.Tensor]:
    return {"partial": lambda: [buf[0:10], buf[5:15]],
            "contained": lambda: [buf[2:12], buf[2:12][5:8]],
            "contained_first": lambda: [buf[7:10], buf[0:15]]}[kind]()


@pytest.mark.parametrize("kind", ["partial", "contained", "contained_first"])
def test_grads_sharing_part_of_their_memory(backend, kind):
    """Reference: torch's op. Triton: refused (a float64 grad beside them unchanged too),
    and refused again at each later call on the same grads (no plan kept for them); a
    read-only check reads them."""
    theirs = torch.full((15,), 4.0)
    torch._amp_foreach_non_finite_check_and_unscale_(_sharing(theirs, kind), torch.zeros(()),
                                                     torch.full((), 0.5))
    ours = torch.full((15,), 4.0)
    other = torch.full((5,), 4.0, dtype=torch.float64)
    grads = [other, *_sharing(ours, kind)]
    for _ in range(3):
        found = torch.zeros(())
        if backend == "reference":
            ops.non_finite_check_and_unscale_(grads, found, torch.full((), 0.5),
                                              backend=backend)
            assert_same(ours, theirs)
            assert_same(other, torch.full((5,), 2.0, dtype=torch.float64))
            break
        with pytest.raises(RuntimeError, match=SHARED):
            ops.non_finite_check_and_unscale_(grads, found, torch.full((), 0.5),
                                              backend=backend)
        assert_same(ours, torch.full((15,), 4.0))
        assert_same(other, torch.full((5,), 4.0, dtype=torch.float64))
    ours[8] = math.nan  # inside every kind's shared part
    found = torch.zeros(())
    ops.non_finite_check_(_sharing(ours, kind), found, torch.ones(()), backend=backend)
    assert found.item() == 1.0


def test_grad_scaler_triton_refuses_grads_sharing_memory_before_any_change(triton_device):
    buf = torch.full((15,), 4.0, device=triton_device)
    params = [torch.nn.Parameter(torch.zeros(n, device=triton_device)) for n in (10, 10)]
    params[0].grad, params[1].grad = buf[0:10], buf[5:15]
    q = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64, device=triton_device))
    q.grad = torch.full((4,), 4.0, dtype=torch.float64, device=triton_device)
    opt = torch.optim.SGD([q, *params], lr=1.0)
    scaler = GradScaler(triton_device.type, init_scale=2.0, backend="triton")
    scaler.scale(torch.ones((), device=triton_device))
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(RuntimeError, match=SHARED):
            call(opt)
        assert_same(buf.cpu(), torch.full((15,), 4.0))
        assert_same(q.grad.cpu(), torch.full((4,), 4.0, dtype=torch.float64))


#: Views of one 12-element buffer: what each backend must do with them ("torch": torch's
#: op's result; "once": every location unscaled once, the alias rule; "refused": nothing
#: changes). A gapped view gets a contiguous copy on the Triton backend, so its memory is
#: checked against the other grads' element by element.
SHARING = {
    "gapped_alias_of_a_dense_one_neither_covering": (
        lambda b: [b[0:5], b[0:10:2]], "refused", "refused"),
    "gapped_alias_inside_a_dense_one": (lambda b: [b[0:10], b[0:10:2]], "once", "refused"),
    "a_dense_grad_on_a_gapped_ones_element": (
        lambda b: [b[0:10:2], b[4:5]], "torch", "refused"),
    "two_gapped_grads_interleaved": (lambda b: [b[0:10:2], b[1:10:2]], "torch", "torch"),
    "a_dense_grad_in_a_gapped_ones_gap": (lambda b: [b[0:10:2], b[3:4]], "torch", "torch"),
    "a_dense_alias_transposed": (
        lambda b: [b[0:6].view(2, 3), b[0:6].view(2, 3).t()], "once", "once"),
    "a_dense_alias_prefix": (lambda b: [b[0:10], b[0:4]], "once", "once"),
    # the smaller alias first: the rule keeps the one with more elements, wherever it is
    "a_dense_alias_prefix_first": (lambda b: [b[0:4], b[0:10]], "once", "once"),
    "gapped_alias_first_inside_a_dense_one": (lambda b: [b[0:10:2], b[0:10]], "once", "refused"),
    "aliases_beside_a_one_element_grad_and_an_empty_one": (
        lambda b: [b[11:12], b[0:10], b[10:10], b[0:4]], "once", "once"),
}


@pytest.mark.parametrize("kind", SHARING)
def test_views_of_one_buffer(backend, kind):
    views, reference_does, triton_does = SHARING[kind]
    expected = {"torch": torch.full((12,), 4.0), "once": torch.full((12,), 4.0),
                "refused": torch.full((12,), 4.0)}
    torch._amp_foreach_non_finite_check_and_unscale_(views(expected["torch"]), torch.zeros(()),
                                                     torch.full((), 0.5))
    for g in views(expected["once"]):
        g.fill_(2.0)
    ours = torch.full((12,), 4.0)
    does = reference_does if backend == "reference" else triton_does
    if does == "refused":
        with pytest.raises(RuntimeError, match="unsupported operation: two gradients"):
            ops.non_finite_check_and_unscale_(views(ours), torch.zeros(()),
                                              torch.full((), 0.5), backend=backend)
    else:
        ops.non_finite_check_and_unscale_(views(ours), torch.zeros(()), torch.full((), 0.5),
                                          backend=backend)
    assert_same(ours, expected[does])


def test_shared_elements_agree_with_every_offset_compared():
    """Random strided views of one buffer, pairwise, against their offsets as Python sets."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.zeros(24)
    seen = {True: 0, False: 0}
    for _ in range(600):
        views = []
        for _ in range(2):
            dims = int(torch.randint(1, 3, (), generator=gen))
            shape = tuple(int(x) for x in torch.randint(1, 4, (dims,), generator=gen))
            strides = tuple(int(x) for x in torch.randint(1, 5, (dims,), generator=gen))
            span = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
            start = int(torch.randint(0, 24 - span + 1, (), generator=gen))
            views.append((buf.as_strided(shape, strides, start), start))
        sets = [{start + sum(i * st for i, st in zip(index, v.stride()))
                 for index in itertools.product(*(range(n) for n in v.shape))}
                for v, start in views]
        expected = bool(sets[0] & sets[1])
        assert share_elements(views[0][0], views[1][0]) == expected
        seen[expected] += 1
    assert min(seen.values()) > 100


def test_offsets_cost_the_elements_not_the_span():
    """A column block of a large matrix spans the matrix: its offsets are counted from its
    elements (before: an arange over the span, 8 bytes an element of the matrix)."""
    assert _offsets((3, 2), (10**12, 1), 5).tolist() == [
        5, 6, 10**12 + 5, 10**12 + 6, 2 * 10**12 + 5, 2 * 10**12 + 6]
    assert _offsets((), (), 7).tolist() == [7]
    assert _offsets((2, 3), (0, 4), 0).tolist() == [0, 4, 8, 0, 4, 8]
    base = torch.arange(2 * 3 * 5.0).view(2, 3, 5)
    for view in (base, base[:, ::2, 1:4], base.permute(2, 0, 1), base[1, :, 3:4]):
        offsets = _offsets(tuple(view.shape), view.stride(), view.storage_offset())
        assert torch.equal(offsets, view.reshape(-1).long())


def test_grads_off_each_others_element_grid_are_taken_as_sharing_memory():
    """Two float32 grads over one host buffer 2 bytes apart (``torch.frombuffer``): where their
    spans meet, no element of one is an element of the other, and they are taken as sharing
    memory (a write to one changes bytes of the other); spans apart, they are not."""
    raw = bytearray(64)
    a = torch.frombuffer(raw, dtype=torch.float32, count=8)
    b = torch.frombuffer(raw, dtype=torch.float32, count=8, offset=2)
    assert b.data_ptr() - a.data_ptr() == 2
    assert share_elements(a, b) and share_elements(b, a)
    assert share_elements(a[::2], b[1::2])
    assert not share_elements(a[:1], b[1:])  # the spans do not meet
    after = torch.frombuffer(raw, dtype=torch.float32, count=2, offset=34)
    assert not share_elements(a, after) and not share_elements(after, a)
