"""What the README's and docs/migrating.md's DeepSpeed rows promise: the migrated scaler stops
a run stuck at the minimum scale where DeepSpeed's fp16 config stops it, and its first growth
comes one clean update earlier than DeepSpeed's (``compat.deepspeed.DynamicLossScaler``
reproduces DeepSpeed's), from the start and after an overflow."""

import math
import re
from pathlib import Path

import pytest
import torch

from triton_scaler import GradScaler, MinScaleReachedError
from triton_scaler.compat import deepspeed as ts_deepspeed

ROOT = Path(__file__).resolve().parent.parent


def _readme_deepspeed_scaler(p: int, window: int, hysteresis: int, min_scale: float, backend):
    """The README row's ``GradScaler(...)``, with DeepSpeed's settings filled in."""
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| DeepSpeed `initial_scale_power"))
    call = re.search(r"`(GradScaler\([^`]*\))`", row).group(1)
    assert "raise_at_min_scale=True" in call, row
    call = call.replace("GradScaler(", f"GradScaler('cpu', backend={backend!r}, ")
    return eval(call, {"GradScaler": GradScaler, "p": p, "W": window, "H": hysteresis,
                       "m": min_scale})


def _step(scaler, overflow: bool):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    loss = param.sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_the_readme_row_stops_where_deepspeed_stops(backend):
    ours = _readme_deepspeed_scaler(p=3, window=100, hysteresis=1, min_scale=1.0,
                                    backend=backend)
    theirs = ts_deepspeed.DynamicLossScaler(init_scale=2.0**3, scale_window=100, min_scale=1.0,
                                            delayed_shift=1, device="cpu", backend=backend)
    for update in range(3):  # 8 -> 4 -> 2 -> 1
        _step(ours, overflow=True)
        theirs.update_scale(True)
        assert ours.get_scale() == theirs.cur_scale == 2.0 ** (2 - update)
    with pytest.raises(Exception, match="Current loss scale already at minimum"):
        theirs.update_scale(True)
    with pytest.raises(MinScaleReachedError):
        _step(ours, overflow=True)


@pytest.mark.parametrize("overflow_first", [False, True])
def test_deepspeeds_first_growth_comes_one_update_later(backend, overflow_first):
    ours = GradScaler("cpu", init_scale=16.0, growth_interval=5, backend=backend)
    theirs = ts_deepspeed.DynamicLossScaler(init_scale=16.0, scale_window=5, min_scale=1.0,
                                            device="cpu", backend=backend)
    if overflow_first:
        _step(ours, overflow=True)
        theirs.update_scale(True)
    start = ours.get_scale()
    ours_growth = theirs_growth = None
    for clean in range(1, 8):
        _step(ours, overflow=False)
        theirs.update_scale(False)
        if ours_growth is None and ours.get_scale() > start:
            ours_growth = clean
        if theirs_growth is None and theirs.cur_scale > start:
            theirs_growth = clean
    assert (ours_growth, theirs_growth) == (5, 6)
