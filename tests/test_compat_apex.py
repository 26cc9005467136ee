"""triton_scaler.compat.apex against apex amp's LossScaler rule and scale_loss behaviour."""

import math

import pytest
import torch
from _peers import ApexAmpOracle, ApexLossScaler, overflow_bursts
from _util import assert_all_same

from triton_scaler import GradBuckets
from triton_scaler.compat.apex import Amp
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted


def _iteration(amp, params, opts, overflow, loss_id=0):
    loss = sum(p.sum() for p in params) * (math.inf if overflow else 1.0)
    with amp.scale_loss(loss, opts, loss_id=loss_id) as scaled:
        scaled.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("min_loss_scale", [None, 2.0**10])
@pytest.mark.parametrize("fused", [False, True])
def test_trajectory_and_skips_match_apex(backend, min_loss_scale, fused):
    amp = Amp(init_scale=2.0**16, min_loss_scale=min_loss_scale, max_loss_scale=2.0**17,
              scale_window=3, backend=backend)
    peer = ApexLossScaler(2.0**16, 3, min_loss_scale, 2.0**17)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=fused)
    for overflow in overflow_bursts(60, 3, p_start=0.15):
        before = p.detach().clone()
        _iteration(amp, [p], [opt], overflow)
        peer.update_scale(overflow)
        assert amp.loss_scale() == peer._loss_scale
        assert torch.equal(p.detach(), before) == overflow  # skipped exactly on overflow
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == peer._unskipped


def test_skip_is_once_and_respects_scheduler_wrappers(backend):
    amp = Amp(backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    wrapped_step = opt.step  # the scheduler's instance-level wrapper
    _iteration(amp, [p], [opt], overflow=True)
    assert opt.step == wrapped_step and torch.equal(p.detach(), torch.ones(2))
    _iteration(amp, [p], [opt], overflow=False)
    assert not torch.equal(p.detach(), torch.ones(2))
    scheduler.step()
    plain = torch.optim.SGD([p], lr=0.5)  # no wrapper: its step is the class's again
    for overflow in (True, False):
        _iteration(amp, [p], [plain], overflow=overflow)
        assert "step" not in vars(plain)


def test_multiple_losses_delay_unscale_and_state_dict(backend):
    amp = Amp(num_losses=2, init_scale=64.0, backend=backend)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    _iteration(amp, [b], [opt_b], overflow=True, loss_id=1)
    assert amp.loss_scale(0) == 64.0 and amp.loss_scale(1) == 32.0
    with amp.scale_loss(a.sum(), opt_a, delay_unscale=True) as scaled:
        scaled.backward()
    assert torch.equal(a.grad, torch.full((2,), 64.0))  # still scaled: accumulating
    with amp.scale_loss(a.sum(), opt_a) as scaled:
        scaled.backward()
    assert torch.equal(a.grad, torch.full((2,), 2.0))  # both micro-batches, unscaled
    state = amp.state_dict()
    assert state == {"loss_scaler0": {"loss_scale": 64.0, "unskipped": 1},
                     "loss_scaler1": {"loss_scale": 32.0, "unskipped": 0}}
    restored = Amp(num_losses=2, backend=backend)
    restored.load_state_dict(state)
    _iteration(restored, [b], [opt_b], overflow=False, loss_id=1)
    assert restored.loss_scale(1) == 32.0 and restored.state_dict()["loss_scaler1"]["unskipped"] == 1
    with pytest.raises(ValueError, match="loss_id must be in"):
        with amp.scale_loss(a.sum(), opt_a, loss_id=2):
            pass


def test_static_loss_scale_never_skips(backend):
    amp = Amp(loss_scale=128.0, backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    _iteration(amp, [p], [opt], overflow=True)
    assert not torch.isfinite(p).all()  # apex's static scaling applies the step
    assert amp.loss_scale() == 128.0


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
def test_growth_stops_at_the_last_finite_scale(backend):
    """With ``max_loss_scale=inf`` apex's Python float grows past fp32's maximum; ours stays
    at the last finite scale (docs/migrating.md), the window starts again, and an overflow backs off
    from it."""
    amp = Amp(init_scale=2.0**127, max_loss_scale=math.inf, scale_window=1, backend=backend)
    peer = ApexLossScaler(2.0**127, 1, None, math.inf)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for overflow, theirs, ours in [(False, 2.0**128, 2.0**127), (True, 2.0**127, 2.0**126)]:
        before = p.detach().clone()
        _iteration(amp, [p], [opt], overflow)
        peer.update_scale(overflow)
        assert torch.equal(p.detach(), before) == overflow
        assert peer._loss_scale == theirs and amp.loss_scale() == ours
        assert amp.state_dict()["loss_scaler0"] == {"loss_scale": ours, "unskipped": 0}


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("cleared", ["set_to_none", "zeros", "GradBuckets"])
@pytest.mark.parametrize("fused", [False, True])
def test_several_losses_on_one_optimizer_as_apex(backend, fused, cleared, micro_batches):
    """apex's multiple-losses recipe: ``scale_loss`` per loss on one optimizer, then one
    ``step()``. apex sets the grads already there aside at each ``scale_loss``, unscales and
    checks only the new loss's gradients and adds the others back: each loss is unscaled by
    its own scale, each scaler backs off for its own overflow only, and the step is skipped
    when any loss overflowed since the last step. ``p`` is in both losses, ``q`` in the
    first only. Scales 2**16 and 2**3: unscaling everything by the last scale is far off.
    With two micro-batches the first loss accumulates (``delay_unscale=True`` first, its
    scaled grads not set aside), and the second loss then sets the sum aside."""
    amp = Amp(num_losses=2, init_scale=2.0**16, scale_window=3, backend=backend)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 2.0**3, "unskipped": 0}})
    peers = [ApexLossScaler(2.0**16, 3), ApexLossScaler(2.0**3, 3)]
    p, q = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p, q], lr=0.5, fused=fused)
    buckets = GradBuckets(opt) if cleared == "GradBuckets" else None
    overflows = [(a, b) for a in (False, True) for b in (False, True)] * 2 + [(True, False)]
    losses = [lambda: (p * 2.0).sum() + (q * 3.0).sum(), lambda: (p * 5.0).sum()]
    for step, (overflow0, overflow1) in enumerate(overflows):
        for loss_id, overflow in enumerate((overflow0, overflow1)):
            for delay in [True] * (micro_batches - 1 if loss_id == 0 else 0) + [False]:
                loss = losses[loss_id]() * (math.inf if overflow else 1.0)
                with amp.scale_loss(loss, opt, loss_id=loss_id, delay_unscale=delay) as scaled:
                    scaled.backward()
            peers[loss_id].update_scale(overflow)
            assert amp.loss_scale(loss_id) == peers[loss_id]._loss_scale
        if not (overflow0 or overflow1):
            assert torch.equal(p.grad, torch.full((5,), 2.0 * micro_batches + 5.0))
            assert torch.equal(q.grad, torch.full((3,), 3.0 * micro_batches))
        before = [t.detach().clone() for t in (p, q)]
        opt.step()
        skipped = all(torch.equal(t.detach(), b) for t, b in zip((p, q), before))
        assert skipped == (overflow0 or overflow1), step
        if buckets is not None:
            buckets.zero_()
        else:
            opt.zero_grad(set_to_none=cleared == "set_to_none")


def test_a_grad_set_aside_and_added_back_is_apexs_to_the_sign_of_zero(backend):
    """apex's ``new * (1 / scale) + old``: -0.0 where both are -0.0 (a grad cleared to +0.0
    before the next backward would make it +0.0)."""
    amp = Amp(num_losses=2, backend=backend)
    r = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([r], lr=0.5)
    for _ in range(2):
        for loss_id in (0, 1):
            with amp.scale_loss((r * -0.0).sum(), opt, loss_id=loss_id) as scaled:
                scaled.backward()
        assert torch.signbit(r.grad).all() and not r.grad.any()
        opt.step()
        opt.zero_grad()


def test_one_loss_over_several_optimizers_and_a_state_loaded_midway(backend):
    """Each optimizer of a ``scale_loss`` is unscaled and skips on overflow, also on an
    overflow in another's grads (apex decides once per call); a state loaded into a scaler
    already in use takes effect (scale and apex's window) at once."""
    amp = Amp(init_scale=64.0, scale_window=2, backend=backend)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opts = [torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5)]
    _iteration(amp, [a, b], opts, overflow=False)
    assert torch.equal(a.detach(), torch.full((2,), 0.5))  # unscaled: grad 1, not 64
    assert torch.equal(b.detach(), torch.full((3,), 0.5))
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}})
    assert amp.loss_scale() == 8.0
    _iteration(amp, [a, b], opts, overflow=False)  # the second clean step of the window
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 16.0, "unskipped": 0}}
    _iteration(amp, [a, b], opts, overflow=True)
    assert torch.equal(a.detach(), torch.zeros(2)) and torch.equal(b.detach(), torch.zeros(3))
    with amp.scale_loss(a.sum() * math.inf + b.sum(), opts) as scaled:  # only a's grads
        scaled.backward()
    for opt in opts:  # one decision per scale_loss, as apex: both steps skipped
        opt.step()
    assert torch.equal(a.detach(), torch.zeros(2)) and torch.equal(b.detach(), torch.zeros(3))
    with pytest.raises(ValueError, match=r"loss_id must be in \[0, 1\); got -1"):
        with amp.scale_loss(a.sum(), opts, loss_id=-1):
            pass


@pytest.mark.parametrize("loss_scale", ["dynamic", 8.0])
def test_optimizers_that_got_no_gradient_step_as_apex(backend, loss_scale):
    """apex checks the grads there are: an optimizer of ``scale_loss`` whose parameters got
    no gradient (None: not reached by this loss) has no overflow of its own and skips only on
    the others', and a call where no optimizer got one (the loss over a parameter outside
    them, or no optimizer passed) is a clean step of apex's window (it raised torch's "No inf
    checks were recorded"). Against ApexAmpOracle; a static scale never skips."""
    amp = Amp(init_scale=64.0, scale_window=2, loss_scale=loss_scale, backend=backend)
    oracle = ApexAmpOracle(1, 64.0, 2)
    sides = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.full((n,), 1.0)) for n in (2, 3, 4)]
        sides.append((params, [torch.optim.SGD([p], lr=0.5) for p in params[:2]]))
    (ours, ours_opts), (theirs, their_opts) = sides
    # (the parameters the loss reaches: 2 is outside the optimizers, overflow, optimizers passed)
    calls = [([0], False, 2), ([0], True, 2), ([2], False, 2), ([2], False, 2), ([1], True, 2),
             ([0, 1], False, 2), ([2], True, 2), ([2], False, 0), ([2], True, 0), ([1], False, 2)]
    for reached, overflow, n_passed in calls:
        for params, all_opts in sides:
            opts = all_opts[:n_passed]
            loss = sum(params[i].sum() for i in reached) * (math.inf if overflow else 1.0)
            if all_opts is ours_opts:
                with amp.scale_loss(loss, opts) as scaled:
                    scaled.backward()
            else:
                (loss * oracle.enter(0, opts, False)).backward()
                oracle.exit(0, opts, False)
        for opt, their_opt in zip(ours_opts, their_opts):
            opt.step()
            if loss_scale == "dynamic":
                oracle.step(their_opt)
            else:  # static: never skipped, as apex's
                their_opt.step()
            opt.zero_grad()
            their_opt.zero_grad()
        expected = oracle.scalers[0]._loss_scale if loss_scale == "dynamic" else 8.0
        assert amp.loss_scale() == expected, (reached, overflow, n_passed)
        assert_all_same(ours, theirs)


def test_scale_loss_takes_apexs_arguments_in_apexs_order(backend):
    """``scale_loss(loss, optimizers, loss_id, model, delay_unscale)`` positionally, as apex
    declares them; the scaled loss is ``loss.float() * scale``; ``delay_overflow_check=True``
    (apex's hook for its own fused optimizers) is refused by name."""
    amp = Amp(init_scale=64.0, backend=backend)
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.ones(1, 2)
    with amp.scale_loss(model(x).sum(), opt, 0, model, True) as scaled:  # delayed
        scaled.backward()
    assert torch.equal(model.weight.grad, torch.full((1, 2), 64.0))  # still scaled
    with amp.scale_loss(model(x).half(), opt, 0, model) as scaled:  # a (1, 1) float16 loss
        assert scaled.dtype == torch.float32 and scaled.tolist() == [[128.0]]
        scaled.sum().backward()
    assert torch.equal(model.weight.grad, torch.full((1, 2), 2.0))  # both, unscaled
    with pytest.raises(ValueError, match="delay_overflow_check must be False"):
        with amp.scale_loss(model(x).sum(), opt, delay_overflow_check=True):
            pass


def test_several_losses_with_sparse_grads(backend):
    """A sparse embedding's grad set aside and added back (its elements, coalesced or not)."""
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.ones_(emb.weight)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    amp = Amp(num_losses=2, init_scale=64.0, backend=backend)
    for _ in range(2):
        with amp.scale_loss(emb(torch.tensor([1, 3])).sum() * 2, opt, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(emb(torch.tensor([3, 4])).sum() * 5, opt, loss_id=1) as scaled:
            scaled.backward()
        assert emb.weight.grad.to_dense()[:, 0].tolist() == [0.0, 2.0, 0.0, 7.0, 5.0, 0.0]
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fused", [False, True])
def test_fused_optimizers_skip_with_no_host_read_and_keep_no_attribute(backend, fused):
    """The step ``scale_loss`` arms: a fused optimizer is handed the flag (``found_inf``,
    torch's protocol) and skips on the device, with no host read; a plain one reads the flag
    once, in ``step``. Neither keeps ``grad_scale`` / ``found_inf`` or a ``step`` of ours
    after the step."""
    amp = Amp(init_scale=2.0**8, backend=backend)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=fused)
    for overflow in (False, True, False):
        before = p.detach().clone()
        with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
            with amp.scale_loss(p.sum() * (math.inf if overflow else 1.0), opt) as scaled:
                scaled.backward()
            opt.step()  # ours around optimizer_step_uncounted's, which pauses torch's own
        assert counter.count == (0 if fused else 1)
        assert torch.equal(p.detach(), before) == overflow
        assert not {"grad_scale", "found_inf", "step"} & set(vars(opt))
        opt.zero_grad()


def test_the_defaults_are_apexs():
    """apex's ``LossScaler`` defaults: one loss, a dynamic scale from 2**16, capped at 2**24,
    doubled after a window of 2000 clean steps."""
    amp = Amp()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0}}
    assert Amp(init_scale=2.0**30).loss_scale() == 2.0**24  # apex caps the initial scale
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    for unskipped, scale_after in ((1998, 2.0**16), (1999, 2.0**17)):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": unskipped}})
        _iteration(amp, [p], [opt], overflow=False)
        assert amp.loss_scale() == scale_after


def test_a_grad_set_to_none_inside_scale_loss_gets_its_values_back(backend):
    """apex's ``post_backward_models_are_masters``: a parameter whose grad is None after the
    backward but had values set aside gets those values back; the others get the sum."""
    amp = Amp(num_losses=2, init_scale=4.0, backend=backend)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a, b], lr=0.5)
    with amp.scale_loss((a * 3.0).sum() + (b * 5.0).sum(), opt, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss((a * 7.0).sum(), opt, loss_id=1) as scaled:
        b.grad = None  # b's values are set aside; this loss does not reach b
        scaled.backward()
    assert torch.equal(a.grad, torch.full((2,), 10.0)) and torch.equal(b.grad, torch.full((3,), 5.0))


def test_apex_state_before_first_use_and_static_scales(backend):
    amp = Amp(backend=backend, scale_window=5)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3}})
    assert amp.loss_scale() == 512.0
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3}}
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with amp.scale_loss(p.sum(), opt) as scaled:
        scaled.backward()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 4}}
    static = Amp(loss_scale=2**30, backend=backend)  # apex ignores max_loss_scale here
    assert static.loss_scale() == 2.0**30
