"""SkipAwareScheduler's queue of device flags, without a GPU: the flag claims to be a CUDA
tensor and its host copy (``copy_to_host_async``) is replaced by a host tensor and an event
whose completion the test decides. The scheduler steps only for applied steps, in order,
never waiting in ``step`` and always in ``flush`` (the CPU and GPU runs themselves are in
test_fused_and_compile.py and test_sync.py)."""

import pytest
import torch

from triton_scaler import schedulers
from triton_scaler.schedulers import SkipAwareScheduler


class _Event:
    """A copy's event: complete once the test says so, or when waited on."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


class _CudaFlag:
    """A last_step_skipped that reports itself on CUDA; holds its value for the fake copy."""

    is_cuda = True

    def __init__(self, skipped: bool) -> None:
        self.skipped = skipped


class _Scaler:
    last_step_skipped: _CudaFlag


class _Counting:
    """A scheduler that counts its steps and keeps a state."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


@pytest.fixture
def queue(monkeypatch):
    """A wrapper over a counting scheduler, a function taking one iteration with the given
    skip flag (returning its event), and the fake copies made."""
    events = []

    def copy(flag):
        events.append(_Event())
        return torch.tensor(flag.skipped), events[-1]

    monkeypatch.setattr(schedulers, "copy_to_host_async", copy)
    scaler = _Scaler()
    wrapped = SkipAwareScheduler(_Counting(), scaler)

    def iteration(skipped: bool) -> _Event:
        scaler.last_step_skipped = _CudaFlag(skipped)
        wrapped.step()
        return events[-1]

    return wrapped, iteration


def test_a_flag_is_applied_once_its_copy_has_landed_and_never_waited_for(queue):
    wrapped, iteration = queue
    first = iteration(False)
    assert wrapped.scheduler.steps == 0 and not first.waited  # pending: no step, no wait
    first.done = True
    second = iteration(True)  # resolves the first; the second still pending
    assert wrapped.scheduler.steps == 1 and not second.waited
    second.done = True
    third = iteration(False)  # the second was skipped: no step for it
    assert wrapped.scheduler.steps == 1
    third.done = True
    fourth = iteration(True)
    assert wrapped.scheduler.steps == 2 and len(wrapped._pending) == 1
    assert not any(e.waited for e in (first, second, third, fourth))


def test_flags_are_applied_in_order(queue):
    """A landed copy behind a pending one waits for it: steps are counted in order."""
    wrapped, iteration = queue
    first = iteration(False)
    second = iteration(False)
    second.done = True
    iteration(True).done = True
    assert wrapped.scheduler.steps == 0
    first.done = True
    iteration(False)
    assert wrapped.scheduler.steps == 2 and len(wrapped._pending) == 1


def test_flush_and_state_dict_wait_for_every_pending_flag(queue):
    wrapped, iteration = queue
    events = [iteration(skipped) for skipped in (False, True, False)]
    wrapped.flush()
    assert wrapped.scheduler.steps == 2 and all(e.waited for e in events)
    assert not wrapped._pending
    events = [iteration(False), iteration(False)]
    assert wrapped.state_dict() == {"steps": 4} and all(e.waited for e in events)


def test_load_state_dict_drops_the_pending_flags(queue):
    wrapped, iteration = queue
    iteration(False)
    wrapped.load_state_dict({"steps": 7})
    wrapped.flush()
    assert wrapped.scheduler.steps == 7


def test_swapped_or_wrong_arguments_are_refused_when_made():
    """``SkipAwareScheduler(scaler, scheduler)`` (swapped) and a scheduler without ``step()``
    raise a TypeError naming the order when made, not at the first ``step()``."""
    from triton_scaler import GradScaler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match=r"takes the LR scheduler first and the GradScaler "
                                        r"second; got \(GradScaler, StepLR\)"):
        SkipAwareScheduler(scaler, scheduler)
    with pytest.raises(TypeError, match="scheduler must be an LR scheduler"):
        SkipAwareScheduler(object(), scaler)
    opt.step()
    SkipAwareScheduler(scheduler, scaler).step()  # the right order works
