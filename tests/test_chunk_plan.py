"""The host side of a launch (``triton_scaler/_plans.py``), on its own: the chunk table's rows,
its memo of rows per size pattern, the grads it leaves out (empty ones, aliases) and the
flat path of a single grad.

The kernels' results over these plans are tested against torch's op elsewhere
(``test_ops_unscale.py``, ``test_overlapping_grads.py``, ``test_grads_sharing_memory.py``);
a plan with a chunk too many (of negative length) or a table built anew each step would
still give those results, so the rows and the memo are checked here, against a table
written out in Python. CPU tensors: a plan is host work (only its upload differs on a
GPU)."""

import pytest
import torch
import triton

from triton_scaler import _plans as plan

BLOCK = 4


@pytest.fixture(autouse=True)
def no_kept_rows():
    """No size pattern of an earlier test."""
    plan.clear()
    yield
    plan.clear()


def _expected_rows(grads: list[torch.Tensor], block: int) -> list[list[int]]:
    """Every grad's chunks in the grads' order: start (elements from ``grads[0]``, negative
    below it) and length, every chunk but a grad's last ``block`` long."""
    base, size = grads[0].data_ptr(), grads[0].element_size()
    rows = []
    for g in grads:
        start = (g.data_ptr() - base) // size
        rows += [[start + k, min(block, g.numel() - k)] for k in range(0, g.numel(), block)]
    return rows


def _resolved(table: torch.Tensor, starts: torch.Tensor, size: int) -> list[list[int]]:
    """The rows as the kernel reads them: each chunk's start (elements from the first
    grad's) and length, from the table's ``(grad, offset, length)`` rows and the starts."""
    at = starts.tolist()
    return [[(at[g] - at[0]) // size + offset, length] for g, offset, length in table.tolist()]


def _rows_of(p) -> list[list[int]]:
    """A plan's rows as the kernel reads them (:func:`_resolved`)."""
    return _resolved(p.table, p.starts, p.base.element_size())


def _views(buffer: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [buffer[start:start + n] for start, n in spans]


# sizes one short of a block, a block, one over, a single element, several blocks and a bit;
# the first grad lies above the others (negative starts)
SPANS = [(40, BLOCK - 1), (0, BLOCK), (5, BLOCK + 1), (11, 1), (13, 3 * BLOCK + 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_rows_are_every_grads_chunks(dtype):
    grads = _views(torch.zeros(64, dtype=dtype), SPANS)
    numels = tuple(n for _, n in SPANS)
    table, starts, overlapping = plan.chunk_table(grads, numels, BLOCK)
    assert table.dtype == starts.dtype == torch.int64
    assert table.shape == (1 + 1 + 2 + 1 + 4, 3) and starts.shape == (5,)
    assert _resolved(table, starts, grads[0].element_size()) == _expected_rows(grads, BLOCK)
    assert overlapping is False


def test_grads_of_sizes_seen_before_get_the_same_rows_and_their_own_starts():
    """The same sizes, at the same or other addresses: the rows of the size pattern, not
    built anew, and starts of their own, which resolve to the grads' chunks; other sizes,
    other rows. The memo keeps the most recently used patterns."""
    buffer = torch.zeros(128)
    grads = _views(buffer, SPANS)
    numels = tuple(n for _, n in SPANS)
    table, starts, _ = plan.chunk_table(grads, numels, BLOCK)
    again = plan.chunk_table(grads, numels, BLOCK, tuple(g.data_ptr() for g in grads))
    assert again[0] is table and torch.equal(again[1], starts)
    other_sizes = _views(buffer, [(0, 3), (3, 9)])
    assert plan.chunk_table(other_sizes, (3, 9), BLOCK)[0] is not table
    for n in range(plan.PATTERNS_KEPT - 1):  # others, beside the first pattern used last
        plan.chunk_table(grads, numels, BLOCK)
        plan.chunk_table([buffer[:n + 1], buffer[n + 1:n + 3]], (n + 1, 2), BLOCK)
    assert plan.chunk_table(grads, numels, BLOCK)[0] is table
    moved = _views(buffer, [(start + 64, n) for start, n in SPANS])
    rows, other, _ = plan.chunk_table(moved, numels, BLOCK)
    assert rows is table and other is not starts
    assert _resolved(rows, other, 4) == _expected_rows(moved, BLOCK)


def test_grads_at_one_address_are_chunked_once_at_the_larger_size():
    buffer = torch.zeros(32)
    grads = [buffer[:3], buffer[10:12], buffer[:7], buffer[10:11]]
    table, starts, overlapping = plan.chunk_table(grads, (3, 2, 7, 1), BLOCK)
    assert _resolved(table, starts, 4) == _expected_rows([buffer[:7], buffer[10:12]], BLOCK)
    assert overlapping is False


def test_grads_sharing_part_of_their_memory_are_flagged():
    buffer = torch.zeros(32)
    *_, overlapping = plan.chunk_table([buffer[:8], buffer[7:9]], (8, 2), BLOCK)
    assert overlapping is True
    *_, overlapping = plan.chunk_table([buffer[:8], buffer[8:10]], (8, 2), BLOCK)
    assert overlapping is False


@pytest.mark.parametrize("n_grads", [3, plan._FEW, plan._FEW + 1, 600])
@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
@pytest.mark.parametrize("shared", [None, "inside", "alias", "touching"])
def test_sharing_is_found_in_any_order_among_few_or_many_grads(n_grads, order, shared):
    """Grads one after another in one buffer (sizes 1 to 9, gaps of 0 to 2): the rows are
    those written out in Python and no memory is shared; one grad moved to start inside the
    one before it shares memory (``inside``), one at the start of the one before it is an
    alias, covered once (``alias``: the longer one's rows), one ending exactly where the
    next starts shares nothing (``touching``). The same in ascending, descending and
    shuffled order, among few grads (Python passes) and many (tensor ops)."""
    gen = torch.Generator().manual_seed(n_grads)
    sizes = torch.randint(1, 10, (n_grads,), generator=gen).tolist()
    gaps = torch.randint(0, 3, (n_grads,), generator=gen).tolist()
    buffer = torch.zeros(sum(sizes) + sum(gaps) + 16)
    starts, at = [], 0
    for n, gap in zip(sizes, gaps):
        starts.append(at)
        at += n + gap
    k = n_grads // 2  # the grad moved, and the one before it
    if shared == "inside":
        starts[k] = starts[k - 1] + sizes[k - 1] - 1
    elif shared == "alias":
        starts[k], sizes[k] = starts[k - 1], sizes[k - 1] - 1 if sizes[k - 1] > 1 else 1
    elif shared == "touching":
        starts[k] = starts[k - 1] + sizes[k - 1]
    grads = [buffer[a:a + n] for a, n in zip(starts, sizes)]
    if order != "ascending":
        perm = list(range(n_grads))[::-1] if order == "descending" else \
            torch.randperm(n_grads, generator=gen).tolist()
        grads = [grads[i] for i in perm]
    table, starts, overlapping = plan.chunk_table(grads, tuple(g.numel() for g in grads),
                                                  BLOCK)
    assert overlapping is (shared == "inside")
    if shared == "alias":  # each address once, with its longest grad, in order of first seen
        longest: dict[int, torch.Tensor] = {}
        for g in grads:
            if g.data_ptr() not in longest or g.numel() > longest[g.data_ptr()].numel():
                longest[g.data_ptr()] = g
        grads = list(longest.values())
    assert _resolved(table, starts, 4) == _expected_rows(grads, BLOCK)


def test_a_single_grad_is_one_flat_launch():
    for n in (1, BLOCK - 1, BLOCK, 3 * BLOCK + 1):
        grad = torch.zeros(n)
        p = plan.build_plan([grad], None, None, BLOCK)
        assert (p.table, p.n, p.grid, p.base) == (None, n, triton.cdiv(n, BLOCK), grad)


def test_empty_grads_are_left_out_and_the_base_is_the_first_non_empty():
    buffer = torch.zeros(64)
    empty = torch.zeros(0)
    lone = plan.build_plan([empty, buffer[3:9], empty], None, None, BLOCK)
    assert (lone.table, lone.n, lone.grid) == (None, 6, 2)
    assert lone.base.data_ptr() == buffer[3:].data_ptr()
    grads = [empty, empty, buffer[5:10], empty, buffer[20:29]]
    many = plan.build_plan(grads, None, None, BLOCK)
    assert many.base.data_ptr() == buffer[5:].data_ptr()
    assert _rows_of(many) == _expected_rows([buffer[5:10], buffer[20:29]], BLOCK)
    assert many.grid == many.table.shape[0] == 2 + 3 and many.n == 0
    none = plan.build_plan([empty, empty], None, None, BLOCK)
    assert (none.base, none.table, none.n, none.grid) == (None, None, 0, 0)


def test_dense_non_contiguous_grads_need_no_copy_and_gapped_ones_do():
    """channels_last and transposed grads are chunked over their memory as it lies; a grad
    with gaps is unscaled through a contiguous copy (a watch then reads it by torch's ops)."""
    channels_last = torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    transposed = torch.zeros(3, 5).t()
    dense = plan.build_plan([channels_last, transposed], None, None, BLOCK)
    assert dense.copies == [] and dense.reusable
    assert _rows_of(dense) == _expected_rows(
        [channels_last.as_strided((24,), (1,)), transposed.as_strided((15,), (1,))], BLOCK)
    gapped = torch.zeros(4, 6)[:, :3]
    copied = plan.build_plan([channels_last, gapped], None, None, BLOCK)
    assert len(copied.copies) == 1 and copied.copies[0][0] is gapped
    assert not copied.reusable and copied.table.shape[0] == 6 + 3


def test_aliased_grads_beside_a_copied_one_are_not_sharing_memory():
    """Grads at one address (``p2.grad = p1.grad``) are unscaled once, also when another grad
    of the launch goes through a copy: only grads that start inside another share memory."""
    buffer = torch.zeros(64)
    gapped = torch.zeros(4, 6)[:, :3]
    aliased = plan.build_plan([buffer[:8], buffer[:8], gapped], None, None, BLOCK)
    assert len(aliased.copies) == 1 and not aliased.overlapping
    shared = plan.build_plan([buffer[:8], buffer[2:4], gapped], None, None, BLOCK)
    assert shared.overlapping
    inside = plan.build_plan([buffer[:8], buffer[2:4].expand(2, 2)], None, None, BLOCK)
    assert inside.overlapping  # the copied grad's memory lies inside the first grad's
