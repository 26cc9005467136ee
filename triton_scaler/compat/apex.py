"""apex amp's loss scaling (``amp.scale_loss``) on triton_scaler's GradScaler.

Each loss gets its own :class:`triton_scaler.GradScaler`, created on the device of the first
loss it scales. apex's rule is torch's with a cap (``max_loss_scale``) and an optional floor
(``min_loss_scale``): both are GradScaler settings. A static ``loss_scale`` never skips.

Several losses may share an optimizer, as in apex's multiple-losses recipe (``scale_loss`` for
each loss, then one ``optimizer.step()``): as apex, each ``scale_loss`` (without
``delay_unscale``) sets the values of the grads already there aside, unscales and checks only
its own loss's gradients, then adds the values set aside back. So each loss is unscaled by its
own scale and each scaler backs off only for its own overflow; the step is skipped when any
of them overflowed since the last step. Costs a copy of the grads where there are grads when
``scale_loss`` starts (a second loss, or grads zeroed rather than set to None), as apex's stash.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._backend import Backend, check_backend
from ..grad_scaler import GradScaler
from ..policy import INT32_MAX, ScalePolicy, as_int, as_real, check_scale_value

_APEX_NAMES = {"growth_interval": "scale_window", "min_scale": "min_loss_scale",
          "max_scale": "max_loss_scale"}
_SKIP_ATTR = "_triton_scaler_apex_pending"


def _apex_name(field: str) -> str:
    return _APEX_NAMES.get(field, field)


class Amp:
    """apex amp's loss-scale handling for ``num_losses`` losses.

    Args:
        num_losses: number of separately scaled losses (``loss_id`` 0 .. num_losses - 1).
        init_scale: initial dynamic scale (capped at ``max_loss_scale``), apex's 2**16.
        min_loss_scale, max_loss_scale: floor (None: none) and cap of the dynamic scale.
        loss_scale: ``"dynamic"`` or a number (a static scale that never skips a step).
        scale_window: clean steps before doubling (apex: 2000).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
    """

    def __init__(self, num_losses: int = 1, init_scale: float = 2.0**16,
                 min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24,
                 loss_scale: float | str = "dynamic", scale_window: int = 2000,
                 backend: Backend = "auto") -> None:
        self.num_losses = as_int("num_losses", num_losses, 1, INT32_MAX, "an int >= 1")
        check_backend(backend)
        self._dynamic = isinstance(loss_scale, str) and loss_scale == "dynamic"
        if self._dynamic:
            self._policy = ScalePolicy.create(
                dict(growth_interval=scale_window,
                     min_scale=0.0 if min_loss_scale is None else min_loss_scale,
                     max_scale=max_loss_scale), name=_apex_name)
            # apex caps the initial scale at max_loss_scale
            self._init = check_scale_value("init_scale", min(as_real("init_scale", init_scale),
                                                             self._policy.max_scale),
                                           self._policy, _apex_name)
        else:  # static: apex ignores the window and the floor / cap, and never skips
            if isinstance(loss_scale, str):
                raise ValueError(f"loss_scale must be 'dynamic' or a number; got {loss_scale!r}")
            self._policy = ScalePolicy(dynamic=False, skip_on_overflow=False)
            self._init = check_scale_value("loss_scale", loss_scale)
        self._backend = backend
        self._scalers: list[GradScaler | None] = [None] * self.num_losses
        self._pending_state: list[dict[str, Any] | None] = [None] * self.num_losses
        # optimizers whose grads hold a delay_unscale backward's scaled gradients (apex's
        # params_have_scaled_gradients): the next scale_loss does not set them aside
        self._scaled_grads: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._no_grads: torch.optim.Optimizer | None = None

    def _placeholder(self) -> torch.optim.Optimizer:
        """An optimizer whose one parameter never gets a gradient, checked by a
        :meth:`scale_loss` without optimizers."""
        if self._no_grads is None:
            self._no_grads = torch.optim.SGD([torch.nn.Parameter(torch.zeros(0))], lr=0.0)
        return self._no_grads

    def _scaler(self, loss_id: int, device: torch.device) -> GradScaler:
        self._check_loss_id(loss_id)
        scaler = self._scalers[loss_id]
        if scaler is None:
            p = self._policy
            scaler = GradScaler(device.type, init_scale=self._init, growth_interval=p.growth_interval,
                                min_scale=p.min_scale, max_scale=p.max_scale, dynamic=p.dynamic,
                                backend=self._backend)
            pending = self._pending_state[loss_id]
            if pending is not None:
                scaler.load_state_dict(pending)
                self._pending_state[loss_id] = None
            self._scalers[loss_id] = scaler
        return scaler

    def _check_loss_id(self, loss_id: object) -> None:
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) \
                or not 0 <= loss_id < self.num_losses:
            raise ValueError(f"loss_id must be in [0, {self.num_losses}); got {loss_id!r}")

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: torch.optim.Optimizer | Sequence[Any],
                   loss_id: int = 0, model: torch.nn.Module | None = None,
                   delay_unscale: bool = False, delay_overflow_check: bool = False
                   ) -> Iterator[torch.Tensor]:
        """Yield ``loss.float() * scale``. On exit (unless ``delay_unscale``) unscale and check
        this loss's gradients, add the grads that were there before back (apex's stash, see
        the module doc), update the scale, and make each optimizer's next ``step()`` a no-op
        if this loss's gradients (in any of ``optimizers``) or an earlier loss's since the
        last step overflowed (once). No host sync here; the plain optimizers' ``step()`` reads
        one flag, fused optimizers skip on the device.

        apex's signature: ``model`` is unused, as in apex. ``delay_overflow_check=True`` (apex's
        hook for its own fused optimizers, which then check the overflow in their ``step``)
        raises ``ValueError``: torch's fused optimizers skip on the device without it."""
        if delay_overflow_check is not False:
            raise ValueError("delay_overflow_check must be False: it hands the overflow check to "
                             "apex's own fused optimizers; torch's fused optimizers (fused=True) "
                             f"skip on the device without it; got {delay_overflow_check!r}")
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) \
            else list(optimizers)
        scaler = self._scaler(loss_id, loss.device)
        stashes = [] if delay_unscale else [
            _stash_grads(opt) for opt in optimizers if opt not in self._scaled_grads]
        yield scaler.scale(loss.float())
        if delay_unscale:
            self._scaled_grads.update(optimizers)
            return
        self._scaled_grads.difference_update(optimizers)
        # no gradient is no overflow, as apex checks the grads there are: an optimizer whose
        # parameters got none skips only on the others' overflow, and a call without
        # optimizers is a clean step of apex's window (torch's rule would raise "No inf checks
        # were recorded")
        checked = optimizers or [self._placeholder()]
        for opt in checked:
            scaler.unscale_(opt)
        flags = [scaler.found_inf(opt) for opt in checked]
        for stash in stashes:
            _add_back(stash)
        if self._dynamic and optimizers:
            # one decision for the whole call, as apex's (an overflow in any of its optimizers'
            # grads skips every one's step); a new tensor: update() zeroes the scaler's flags
            found_inf = torch.stack([flag.to(flags[0].device) for flag in flags]).amax()
            for opt, flag in zip(optimizers, flags):  # (each on its optimizer's device)
                _skip_next_step_if(opt, found_inf.to(flag.device))
        scaler.update()

    def loss_scale(self, loss_id: int = 0) -> float:
        """The current scale of ``loss_id`` (synchronises); a loaded state counts before the
        first :meth:`scale_loss`."""
        return self._entry(loss_id)["loss_scale"]

    def _entry(self, loss_id: int) -> dict[str, float | int]:
        self._check_loss_id(loss_id)
        scaler, pending = self._scalers[loss_id], self._pending_state[loss_id]
        if scaler is not None:
            return {"loss_scale": scaler.get_scale(), "unskipped": scaler._get_growth_tracker()}
        if pending is not None:
            return {"loss_scale": pending["scale"], "unskipped": pending["_growth_tracker"]}
        return {"loss_scale": self._init, "unskipped": 0}

    def state_dict(self) -> dict[str, dict[str, float | int]]:
        """apex's format: ``{"loss_scaler<i>": {"loss_scale": ..., "unskipped": ...}}``."""
        return {f"loss_scaler{i}": self._entry(i) for i in range(self.num_losses)}

    def load_state_dict(self, state_dict: dict[str, dict[str, float | int]]) -> None:
        """Load apex's format. Every entry is validated before anything changes; errors name
        the entry."""
        expected = [f"loss_scaler{i}" for i in range(self.num_losses)]
        if not isinstance(state_dict, dict) or sorted(state_dict) != sorted(expected):
            raise ValueError(f"state_dict must have exactly the keys {expected} (this Amp has "
                             f"{self.num_losses} losses); got "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else state_dict!r}")
        states = []
        for key in expected:
            entry = state_dict[key]
            if not isinstance(entry, dict) or {"loss_scale", "unskipped"} - set(entry):
                raise ValueError(f"state_dict[{key!r}] must be a dict with 'loss_scale' and "
                                 f"'unskipped'; got {entry!r}")
            policy = self._policy if self._dynamic else None
            scale = check_scale_value(f"state_dict[{key!r}]['loss_scale']", entry["loss_scale"],
                                      policy, _apex_name)
            unskipped = as_int(f"state_dict[{key!r}]['unskipped']", entry["unskipped"], 0,
                               INT32_MAX, "an int >= 0")
            states.append({"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": self._policy.growth_interval,
                           "_growth_tracker": unskipped})
        for i, torch_state in enumerate(states):
            made = self._scalers[i]
            if made is None:
                self._pending_state[i] = torch_state
            else:
                made.load_state_dict(torch_state)


def _stash_grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Set the values of the optimizer's grads aside (apex's ``_prepare_amp_backward``) and
    clear the grads in place, so the next backward's gradients are alone in them; each grad
    keeps its identity (a GradBuckets or DDP bucket view stays a view). Cleared with -0.0, as
    GradBuckets clears: ``-0.0 + g`` is ``g`` bit for bit, as a fresh grad would be. Returns
    (parameter, saved values) pairs; no grads (``zero_grad(set_to_none=True)``): nothing."""
    stash = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                stash.append((p, p.grad.clone()))
                if p.grad.is_sparse:
                    p.grad.zero_()  # no elements: the next gradient's alone
                else:
                    p.grad.fill_(-0.0)
    return stash


def _add_back(stash: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """apex's ``post_backward_models_are_masters``: each grad becomes its own loss's unscaled
    gradient plus the values set aside (apex's ``a * new + 1 * old``: the same values, as
    ``new * (1 / scale)`` is exact for apex's power-of-two scales)."""
    with torch.no_grad():
        for p, saved in stash:
            if p.grad is None:
                p.grad = saved
            else:
                p.grad.add_(saved)


def _skip_next_step_if(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Make the optimizer's next ``step()`` a no-op when ``found_inf`` is set, or was for a
    loss since the last step (apex keeps an unconsumed skip: ``already_patched``)."""
    pending = optimizer.__dict__.get(_SKIP_ATTR)
    if pending is not None:  # an earlier patch that was never consumed: either flag skips
        found_inf = torch.maximum(pending[2], found_inf)
        _restore_step(optimizer)
    had_own_step = "step" in optimizer.__dict__  # e.g. an LR scheduler's wrapper
    original = optimizer.step
    setattr(optimizer, _SKIP_ATTR, (had_own_step, original, found_inf))

    def step(*args, **kwargs):
        _restore_step(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # torch's fused-optimizer contract: two attributes set for the one step
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                return original(*args, **kwargs)  # skips on the device: no sync
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        if not found_inf.item():  # the one host read of the plain route
            return original(*args, **kwargs)
        return None

    optimizer.step = step  # type: ignore[method-assign]  # (an instance attribute)


def _restore_step(optimizer: torch.optim.Optimizer) -> None:
    had_own_step, original, _ = optimizer.__dict__.pop(_SKIP_ATTR)
    if had_own_step:
        optimizer.step = original  # type: ignore[method-assign]
    else:
        del optimizer.step
