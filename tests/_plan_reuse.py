"""What the tests of grads whose memory changes (``test_plan_reuse.py``) and of parameters
that change (``test_plan_reuse_params.py``) share: a run against torch's scaler, and
training over grads in fixed memory."""

import torch
from _util import assert_all_same

from triton_scaler import GradScaler


def assert_matches_torch(run, backend, **kwargs):
    """``run(scaler) -> (scale(s), params)`` gives the same with torch's scaler and ours."""
    expected = run(torch.amp.GradScaler("cpu", **kwargs))
    actual = run(GradScaler("cpu", **kwargs, backend=backend))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def train_in_fixed_memory(scaler, before_backward, steps=5):
    """SGD over parameters of 7, 300 and 33 elements whose grads are views at the start of
    three fixed buffers (so each grad starts where it did the step before), with
    ``before_backward(step, params, memory, opt)`` changing things each step. Returns the
    scale, the parameters and the buffers (what a stale launch plan would write past a
    grad's end shows there)."""
    torch.manual_seed(0)
    memory = [torch.zeros(20), torch.zeros(700), torch.zeros(80)]
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 33)]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        for p, m in zip(params, memory):
            m.fill_(1.0)
            p.grad = m.view(p.dtype)[: p.numel()].zero_()
        before_backward(step, params, memory, opt)
        scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))).backward()
        if step == 3 and params[1].numel() >= 300:  # the grown or converted grad's last element
            params[1].grad[-1] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in params] + memory
