"""The update kernel's bookkeeping on its own (``kernels/update.py`` ``launch_update_scale``):
the scaler's whole ``update()`` in one launch records the skipped step, zeroes the flags for
the next iteration and, static, leaves the scale. The scale / tracker math is tested against
torch's op in ``test_ops_update.py``, and the scalers against torch's scaler, where a record
left out or flags never zeroed can hide behind the host-side state (mutation testing: each
passed). Here each piece is asked for, and left out, on its own."""

import math

import pytest
import torch
from _util import assert_same
from triton_scaler.kernels import launch_update_scale, update

from triton_scaler import ScalePolicy


def _behind_zeros(flags: torch.Tensor) -> torch.Tensor:
    """``flags`` (0-d for one) in the second half of a zeroed buffer: a kernel that read
    before them would see no overflow."""
    n = flags.numel()
    buffer = torch.zeros(2 * n, dtype=flags.dtype, device=flags.device)
    buffer[n:] = flags
    return buffer[n:] if n > 1 else buffer[1:].view(())


def _state(device, flags):
    return dict(
        scale=torch.tensor(8.0, device=device),
        growth_tracker=torch.tensor(1, dtype=torch.int32, device=device),
        found_inf=_behind_zeros(torch.tensor(flags, dtype=torch.float32, device=device)),
        params=ScalePolicy(growth_interval=2).kernel_params(device),
        skipped=torch.tensor(True, device=device),
        skipped_count=torch.tensor(5, dtype=torch.int64, device=device),
    )


@pytest.fixture
def launched_tensors(monkeypatch):
    """The tensor arguments of each launch: tensors all (a pointer left out as None would
    pass the interpreter; the direct launcher reads every one's address)."""
    seen = []

    def launch(kernel, grid, tensors, *rest):
        seen.append(tensors)
        return real(kernel, grid, tensors, *rest)

    real = update.launch
    monkeypatch.setattr(update, "launch", launch)
    return seen


@pytest.mark.parametrize("flags, overflow", [
    ([0.0], False), ([math.inf], True), ([0.0, 0.0, 0.0, math.nan], True),
    ([0.0, 0.0], False), ([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0], True)])
@pytest.mark.parametrize("record, reset, dynamic", [
    (True, True, True), (True, False, True), (False, True, True), (False, False, False),
    (True, True, False)])
def test_each_piece_of_the_update_on_its_own(triton_device, launched_tensors, flags, overflow,
                                             record, reset, dynamic):
    s = _state(triton_device, flags)
    before = {k: v.clone() for k, v in s.items()}
    launch_update_scale(
        s["scale"], s["growth_tracker"], s["found_inf"], s["params"], None, False,
        dynamic=dynamic, skipped=s["skipped"] if record else None,
        skipped_count=s["skipped_count"] if record else None, reset_found=reset)
    assert len(launched_tensors) == 1
    assert all(isinstance(t, torch.Tensor) for t in launched_tensors[0])
    grown = torch.tensor(16.0), torch.tensor(0, dtype=torch.int32)  # the interval reached
    backed = torch.tensor(4.0), torch.tensor(0, dtype=torch.int32)
    scale, tracker = ((backed if overflow else grown) if dynamic
                      else (before["scale"].cpu(), before["growth_tracker"].cpu()))
    assert_same(s["scale"].cpu(), scale)
    assert_same(s["growth_tracker"].cpu(), tracker)
    assert_same(s["found_inf"].cpu(), torch.zeros_like(before["found_inf"]).cpu() if reset
                else before["found_inf"].cpu())
    if record:
        assert_same(s["skipped"].cpu(), torch.tensor(overflow))
        assert_same(s["skipped_count"].cpu(), torch.tensor(5 + overflow))
    else:
        assert_same(s["skipped"], before["skipped"])
        assert_same(s["skipped_count"], before["skipped_count"])


def test_a_uint8_view_of_the_skipped_flag_is_written_as_it_is(triton_device):
    s = _state(triton_device, [math.inf])
    flag = torch.zeros((), dtype=torch.uint8, device=triton_device)
    launch_update_scale(s["scale"], s["growth_tracker"], s["found_inf"], s["params"], None,
                        False, skipped=flag, skipped_count=s["skipped_count"])
    assert flag.item() == 1 and s["skipped_count"].item() == 6


@pytest.mark.parametrize("found_inf", [torch.zeros(3), torch.zeros(6), torch.zeros(8)[::2]],
                         ids=["three", "six", "strided"])
def test_flags_not_a_contiguous_power_of_two_count_are_refused(found_inf):
    s = _state("cpu", [0.0])
    with pytest.raises(ValueError, match="found_inf must hold a power-of-two count of "
                                         "contiguous flags; got"):
        launch_update_scale(s["scale"], s["growth_tracker"], found_inf, s["params"], None, False)
