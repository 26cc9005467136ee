"""Two grads that share part of their memory (one starts inside another): torch's op
multiplies the shared part once per grad; the kernel's programs run in no fixed order on a
GPU. The reference path is torch's op. The Triton backend refuses to write such grads,
before any grad changes, and reads them in a check. (Grads that start at the same address
are unscaled once on both backends, on purpose: docs/exactness.md. A grad whose own
elements share memory: test_overlapping_grads.py.)"""

import itertools
import math

import pytest
import torch
from _util import assert_same

from triton_scaler import GradScaler, ops
from triton_scaler._memory import _offsets, share_elements
from triton_scaler._plans import _ranges_overlap

SHARED = "two gradients share part of their memory"


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
