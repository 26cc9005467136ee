"""The O(1) bucket check's counts (buffer writes against autograd's accumulations) around
``scaler.scale()``, which forgets the writes no accumulation balanced before a backward
(held views with ``zero_grad(set_to_none=False)``: test_buckets_held_views.py)."""

import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, _bucket


def test_a_written_view_of_an_unused_parameter_survives_another_scalers_scale(monkeypatch,
                                                                              backend):
    """Under DDP (``find_unused_parameters=True``) the reduced gradient of a parameter this
    rank did not use is written into its view after the backward. A second scaler's
    ``scale()`` (a second model's loss) between that backward and this scaler's step forgets
    the write for the O(1) check, not for finding such views: the parameter steps with that
    gradient, as under torch's scaler, where DDP's grad is a tensor of its own."""
    monkeypatch.setattr(_bucket, "_distributed", lambda: True)  # (no process group needed)
    results = []
    for ours in (False, True):
        params = [torch.nn.Parameter(torch.full((n,), 1.0)) for n in (5, 3)]
        opt = torch.optim.SGD(params, lr=0.5)
        if ours:
            GradBuckets(opt).zero_()
        make = (lambda: GradScaler("cpu", init_scale=4.0, backend=backend)) if ours else \
            (lambda: torch.amp.GradScaler("cpu", init_scale=4.0))
        scaler, other = make(), make()
        scaler.scale(params[0].sum()).backward()
        with torch.no_grad():  # DDP's reduced gradient, scaled
            if ours:
                params[1].grad.fill_(8.0)
            else:
                params[1].grad = torch.full((3,), 8.0)
        other.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])
    assert results[0][1].tolist() == [0.0] * 3  # 1 - 0.5 * 8 / 4
