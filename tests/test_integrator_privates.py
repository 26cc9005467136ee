"""The privates that integrators use, against torch's: ``_unscale_grads_`` (called directly, or
overridden by a subclass as fairscale / fairseq do to unscale fp16 grads),
``_check_inf_per_device`` and ``_per_optimizer_states``, then ``update()`` without ``step()``."""

import math
from collections import defaultdict

import pytest
import torch
from _util import assert_all_same
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from triton_scaler import GradBuckets, GradScaler


def _params(dtype, special=None, where=(0, 0)):
    """Two parameters of odd sizes whose grads are finite, or hold ``special`` at ``where``
    (tensor, index)."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 1025)]
    for i, p in enumerate(params):
        p.grad = torch.linspace(-3.0, 5.0, p.numel()).to(dtype) * 64.0 * (i + 1)
    if special is not None:
        params[where[0]].grad[where[1]] = special
    return params


def _values(per_device: dict) -> list[tuple[torch.device, float]]:
    return [(device, t.item()) for device, t in per_device.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("special, where", [(None, None), (math.inf, (0, 0)),
                                            (-math.inf, (1, -1)), (math.nan, (1, 0))])
def test_private_calls_match_torch(backend, dtype, special, where):
    """apex / NeMo-style code: ``_unscale_grads_`` with its own inv_scale and found_inf (fp16
    allowed), the read-only ``_check_inf_per_device``, the per-optimizer record, ``update()``."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
                   GradScaler("cpu", init_scale=2.0**10, growth_interval=1, backend=backend)):
        params = _params(dtype, special, where)
        opt = torch.optim.SGD(params, lr=0.1)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        inv_scale, found_inf = torch.full((), 1.0 / 512, dtype=torch.float32), torch.zeros(())
        unscaled = _values(scaler._unscale_grads_(opt, inv_scale, found_inf, True))
        assert found_inf.item() == 0.0  # torch's returns copies: its argument stays as it was
        grads = [p.grad.clone() for p in params]
        checked = _values(scaler._check_inf_per_device(opt))
        recorded = _values(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"])
        assert_all_same([p.grad for p in params], grads)  # the check leaves them as they are
        scaler.update()
        results.append((grads, unscaled, checked, recorded, scaler.get_scale(),
                        scaler._growth_tracker.item()))
    theirs, ours = results
    assert_all_same(ours[0], theirs[0])
    assert ours[1:] == theirs[1:]
    assert ours[1] == [(torch.device("cpu"), 0.0 if special is None else 1.0)]


@pytest.mark.parametrize("dtype, overflows", [(torch.float16, True), (torch.float32, False)])
def test_uncoalesced_sparse_grads_are_checked_as_torch(backend, dtype, overflows):
    """A sparse grad with repeated indices (an embedding looked up twice): torch coalesces an
    fp16 one before checking it (the sums of its duplicates can overflow where no value
    does: 40000 + 40000 > 65504) and leaves the coalesced grad on the parameter; other dtypes
    are checked as they are. ``_unscale_grads_`` with fp16 allowed, as fairscale's."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", backend=backend)):
        p = torch.nn.Parameter(torch.zeros(5, 2, dtype=dtype))
        p.grad = torch.sparse_coo_tensor([[1, 3, 1]], torch.full((3, 2), 40000.0, dtype=dtype),
                                         (5, 2), check_invariants=True)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        found_inf = torch.zeros(())
        per_device = scaler._unscale_grads_(opt, torch.ones(()), found_inf, True)
        results.append((_values(per_device), p.grad.is_coalesced(), p.grad.to_dense()))
    theirs, ours = results
    assert ours[:2] == theirs[:2] == ([(torch.device("cpu"), float(overflows))], overflows)
    assert_all_same([ours[2]], [theirs[2]])


def test_a_check_after_the_grads_are_mended_starts_from_zero_as_torchs(backend):
    """``unscale_`` finds an inf; the integrator mends the grad and checks again with
    ``_check_inf_per_device``: as torch's, that check starts from a zero found_inf, so the
    step is taken and the scale grows on schedule."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1),
                   GradScaler("cpu", init_scale=8.0, growth_interval=1, backend=backend)):
        params = _params(torch.float32, math.inf, (1, 3))
        opt = torch.optim.SGD(params, lr=0.1)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scaler.unscale_(opt)
        first = _values(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"])
        params[1].grad.nan_to_num_(posinf=0.0)
        checked = _values(scaler._check_inf_per_device(opt))
        scaler.step(opt)
        scaler.update()
        results.append((first, checked, scaler.get_scale(), [p.detach() for p in params]))
    theirs, ours = results
    assert ours[:3] == theirs[:3] == ([(torch.device("cpu"), 1.0)],
                                      [(torch.device("cpu"), 0.0)], 16.0)
    assert_all_same(ours[3], theirs[3])


def _fp16_unscaling(base):
    """A subclass of ``base`` that unscales fp16 grads, as fairscale's and fairseq's do, and
    records how it is called."""

    class Fp16Unscaling(base):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            self.calls.append((inv_scale.item(), allow_fp16))
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    return Fp16Unscaling


@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
@pytest.mark.parametrize("fused, clip_ours", [(False, "torch"), (False, "scaler"), (True, None)])
def test_a_subclass_overriding_unscale_grads_is_called_as_torchs(backend, fused, clip_ours,
                                                                 buckets):
    """A pure fp16 model through a subclass that allows fp16 grads: torch's ``unscale_`` and
    fused route call the override; ours too (also ``scaler.clip_grad_norm_``, and with the
    fp16 grads in a gradient bucket), with the same arguments, and training (with clipping,
    an overflow and a skipped step) ends bit-identical."""
    runs = []
    for make in (lambda: _fp16_unscaling(torch.amp.GradScaler)("cpu", init_scale=2.0**8,
                                                                  growth_interval=2),
                 lambda: _fp16_unscaling(GradScaler)("cpu", init_scale=2.0**8,
                                                      growth_interval=2, backend=backend)):
        torch.manual_seed(0)
        model = torch.nn.Linear(33, 5).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused)
        scaler = make()
        if buckets and isinstance(scaler, GradScaler):
            GradBuckets(opt)
        scaler.calls = []
        scales = []
        for step in range(5):
            opt.zero_grad(set_to_none=not buckets)
            x = torch.randn(4, 33).half() * (math.inf if step == 2 else 1.0)
            scaler.scale(model(x).float().square().mean()).backward()
            if not fused and clip_ours == "scaler" and isinstance(scaler, GradScaler):
                scaler.clip_grad_norm_(opt, 1.0)
            elif not fused:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(([p.detach().clone() for p in model.parameters()], scales, scaler.calls))
    (theirs, their_scales, their_calls), (ours, our_scales, our_calls) = runs
    assert_all_same(ours, theirs)
    assert our_scales == their_scales and our_calls == their_calls
    assert len(our_calls) == 5 and {a for _, a in our_calls} == {fused}


def _nemo_style(base):
    """A subclass of ``base`` that decides the step itself, as NeMo's GradScaler does: it sums
    the per-device found_inf of the optimizer state on the host."""

    class DecidesTheStep(base):
        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            found_inf = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
            self.skipped.append(found_inf != 0)
            return None if found_inf else optimizer.step(*args, **kwargs)

    return DecidesTheStep


def test_a_subclass_deciding_the_step_sees_torchs_optimizer_state(backend):
    runs = []
    for make in (lambda: _nemo_style(torch.amp.GradScaler)("cpu", init_scale=2.0**8),
                 lambda: _nemo_style(GradScaler)("cpu", init_scale=2.0**8, backend=backend)):
        torch.manual_seed(0)
        model = torch.nn.Linear(33, 5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        scaler = make()
        scaler.skipped = []
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(4, 33) * (math.nan if step == 1 else 1.0)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        runs.append(([p.detach().clone() for p in model.parameters()], scaler.skipped,
                     scaler.get_scale()))
    (theirs, their_skips, their_scale), (ours, our_skips, our_scale) = runs
    assert_all_same(ours, theirs)
    assert our_skips == their_skips == [False, True, False, False]
    assert our_scale == their_scale == 2.0**7


def _own_update(base):
    """A subclass of ``base`` with its own ``update`` (NeMo's shape: combine the recorded
    found_infs, ``torch._amp_update_scale_``, forget the iteration); ours never runs."""

    class OwnUpdate(base):
        def update(self, new_scale=None):
            scale, growth_tracker = self._check_scale_growth_tracker("update")
            found_infs = [f.to(scale.device) for state in self._per_optimizer_states.values()
                          for f in state["found_inf_per_device"].values()]
            combined = torch.stack(found_infs).amax()
            torch._amp_update_scale_(scale, growth_tracker, combined, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    return OwnUpdate


@pytest.mark.parametrize("fused", [False, True])
def test_a_subclass_with_its_own_update_trains_as_torchs(backend, fused):
    """Twelve iterations (more than the scaler's found_inf slots) with overflows at 2 and 9
    under an ``update`` that never zeroes the scaler's flags: same skips, scales, parameters."""
    runs = []
    for make in (lambda: _own_update(torch.amp.GradScaler)("cpu", init_scale=2.0**8,
                                                            growth_interval=3),
                 lambda: _own_update(GradScaler)("cpu", init_scale=2.0**8, growth_interval=3,
                                                 backend=backend)):
        torch.manual_seed(0)
        model = torch.nn.Linear(33, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused)
        scaler = make()
        scales = []
        for step in range(12):
            opt.zero_grad()
            x = torch.randn(4, 33) * (math.inf if step in (2, 9) else 1.0)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(([p.detach().clone() for p in model.parameters()], scales))
    (theirs, their_scales), (ours, our_scales) = runs
    assert_all_same(ours, theirs)
    assert our_scales == their_scales
    assert our_scales[2] == 2.0**7 and our_scales[9] == our_scales[8] / 2  # both skipped


@pytest.mark.parametrize("replace", ["made_again", "assigned"])
def test_update_writes_the_state_tensors_the_scaler_holds_now(backend, replace):
    """``update()``'s device work is bound once and kept while its tensors stay the same: state
    tensors made again (``_scale`` and ``_growth_tracker`` set to None, as torch's pickled
    state has them: the next ``scale()`` makes every state tensor anew), or a new ``_scale``
    and ``_growth_tracker`` assigned, are the ones updated afterwards, as with torch's."""
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
                   GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)):
        torch.manual_seed(0)
        model = torch.nn.Linear(33, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scales = []
        for step in range(7):
            if step == 3 and replace == "made_again":
                scaler._scale = scaler._growth_tracker = None
            elif step == 3:
                scaler._scale = torch.full((), 2.0**4)
                scaler._growth_tracker = torch.ones((), dtype=torch.int32)
            opt.zero_grad()
            x = torch.randn(4, 33) * (math.inf if step == 5 else 1.0)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            scales.append((scaler.get_scale(), scaler._growth_tracker.item()))
        runs.append(([p.detach().clone() for p in model.parameters()], scales))
    (theirs, their_scales), (ours, our_scales) = runs
    assert_all_same(ours, theirs)
    assert our_scales == their_scales
    assert our_scales[3] == ((2.0**8, 1) if replace == "made_again" else (2.0**5, 0))


def test_a_second_check_in_one_iteration_replaces_the_first_as_torch(backend):
    """``_check_inf_per_device`` twice before ``step``, the inf repaired in between (a
    Lightning-style skip check, then the step's own): torch keeps only the last record, so
    the step runs and the scale grows; ours re-zeroes the optimizer's one flag slot rather
    than leaving the first check's 1.0 in a slot that ``update()`` reads."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
                   GradScaler("cpu", init_scale=2.0**10, growth_interval=1, backend=backend)):
        params = _params(torch.float32, math.inf, (1, -1))
        opt = torch.optim.SGD(params, lr=0.1)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        first = _values(scaler._check_inf_per_device(opt))
        params[1].grad[-1] = 0.0
        second = _values(scaler._check_inf_per_device(opt))
        scaler.step(opt)
        scaler.update()
        results.append((first, second, scaler.get_scale(), [p.detach() for p in params]))
    (*theirs, their_params), (*ours, our_params) = results
    assert ours == theirs
    assert theirs[:2] == [[(torch.device("cpu"), 1.0)], [(torch.device("cpu"), 0.0)]]
    assert theirs[2] == 2.0**11
    assert_all_same(our_params, their_params)


@pytest.mark.parametrize("override", [False, True], ids=["plain", "overriding_unscale_grads"])
def test_a_check_after_unscale_decides_the_step_as_torchs(backend, override):
    """``unscale_`` finds an inf, the grad is mended, ``_check_inf_per_device`` finds none:
    torch's step reads the check's record, so it steps and the scale grows. Through a
    subclass overriding ``_unscale_grads_`` the records are copies of the flag (torch's
    ``_MultiDeviceReplicator``), so the overflow agreed at ``unscale_`` must be dropped."""
    results = []
    for base in (torch.amp.GradScaler, GradScaler):
        kwargs = {} if base is torch.amp.GradScaler else {"backend": backend}
        make = _fp16_unscaling(base) if override else base
        scaler = make("cpu", init_scale=2.0**10, growth_interval=1, **kwargs)
        scaler.calls = []
        params = _params(torch.float32, math.inf, (1, -1))
        opt = torch.optim.SGD(params, lr=0.1)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scaler.unscale_(opt)
        params[1].grad[-1] = 0.0
        checked = _values(scaler._check_inf_per_device(opt))
        scaler.step(opt)
        scaler.update()
        results.append((checked, scaler.get_scale(), [p.detach().clone() for p in params]))
    (*theirs, their_params), (*ours, our_params) = results
    assert ours == theirs == [[(torch.device("cpu"), 0.0)], 2.0**11]
    assert_all_same(our_params, their_params)
