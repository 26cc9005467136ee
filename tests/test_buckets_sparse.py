"""GradBuckets and sparse gradients: a sparse embedding stays out of the buckets (its grad
would be added dense into a bucket view), and trains as torch's scaler does beside them."""

import math

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_embedding_left_out_of_the_buckets_matches_torch(backend, optimizer, dtype):
    """A sparse embedding's grad accumulates dense in a bucket view (autograd adds a sparse
    grad into an existing dense .grad), so it stays out of the buckets (docs/buckets.md); the buckets
    over the other parameters and the embedding's sparse grad on the per-tensor path train as
    torch's scaler does, overflow steps (an inf in a looked-up row, or in the dense part)
    and repeated indices included."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(6, 3, generator=gen) for _ in range(5)]
    weights[1][0, 0], weights[3][5, 2] = math.inf, math.nan
    indices = [torch.tensor(i) for i in ([0, 4, 4, 6, 0, 1], [6, 6, 6, 6, 6, 6], [2, 0, 4, 5, 1, 1],
                                         [3, 3, 0, 1, 2, 2], [1, 2, 3, 4, 5, 6])]
    make = {"sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}[optimizer]

    def run(scaler, buckets):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(7, 3, sparse=True).to(dtype)
        dense = torch.nn.Parameter(torch.randn(5, 3))
        opt = make([emb.weight, dense])
        if buckets:
            GradBuckets([dense])
        scales = []
        for step, (idx, w) in enumerate(zip(indices, weights)):
            opt.zero_grad(set_to_none=False)  # keeps the views; the sparse grad stays sparse
            loss = (emb(idx).float() * w).sum() + (dense * (math.inf if step == 2 else 1.0)).sum()
            scaler.scale(loss).backward()
            assert emb.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [emb.weight.detach(), dense.detach()]

    expected = run(torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2), False)
    actual = run(GradScaler("cpu", init_scale=4.0, growth_interval=2, backend=backend), True)
    assert actual[0] == expected[0] == [4.0, 2.0, 1.0, 0.5, 0.5]
    assert_all_same(actual[1], expected[1])


def test_a_sparse_embedding_in_a_bucket_gets_a_dense_grad():
    """What docs/buckets.md warns of: inside a bucket the sparse grad is added into the dense view."""
    emb = torch.nn.Embedding(7, 3, sparse=True)
    GradBuckets([emb.weight])
    emb(torch.tensor([1, 1, 5])).sum().backward()
    assert not emb.weight.grad.is_sparse
    assert emb.weight.grad.sum(dim=1).tolist() == [0.0, 6.0, 0.0, 0.0, 0.0, 3.0, 0.0]


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")  # step 3's
def test_a_bucketed_embedding_whose_grad_autograd_makes_sparse_again_stays_sparse(backend):
    """A sparse embedding in a bucket, unused for a step (the scaler sets its grad None) and
    used again with ``zero_grad(set_to_none=False)`` in between: autograd makes a *sparse* grad,
    which stays outside the bucket (the per-tensor path unscales its values, an inf among them
    skips the step) and steps as under torch's scaler, not copied dense into its view."""
    def run(scaler, ours):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(7, 3, sparse=True)
        dense = torch.nn.Parameter(torch.randn(5, 3))
        opt = torch.optim.SGD([emb.weight, dense], lr=0.1)
        zero_grad = GradBuckets(opt).zero_ if ours else opt.zero_grad
        seen = []
        for step, idx in enumerate(([0, 4, 6], None, [2, 5, 1], [3, 0, 6])):
            loss = dense.sum()
            if idx is not None:
                rows = emb(torch.tensor(idx))
                loss = loss + (rows * (math.inf if step == 3 else 1.0)).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            grad = emb.weight.grad
            seen.append((scaler.get_scale(), None if grad is None else grad.is_sparse))
            zero_grad() if step == 0 else opt.zero_grad(set_to_none=False)
        return seen, [emb.weight.detach(), dense.detach()]

    expected = run(torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2), False)
    actual = run(GradScaler("cpu", init_scale=4.0, growth_interval=2, backend=backend), True)
    assert expected[0] == [(4.0, True), (8.0, None), (8.0, True), (4.0, True)]
    assert actual[0][1:] == expected[0][1:]  # (the first step's grad: dense in the bucket)
    assert_all_same(actual[1], expected[1])
