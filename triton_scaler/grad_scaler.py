"""``triton_scaler.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose device work runs in
fused Triton kernels (or the bit-exact PyTorch reference path), with the extensions of
Megatron-core, DeepSpeed, apex and MindSpore scalers."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator

from . import _traced, ops, reference
from ._arguments import check_device, check_outputs, check_process_group
from ._backend import Backend, check_backend
from ._bucket import before_backward
from ._clip import ClipMixin
from ._distributed import agree_over_meshes
from ._eager import eager_under_compile, run_eagerly
from ._grads import PerDevice, grad_groups
from ._plans import refuse_group_writes
from ._step import step_takes_grad_scaler
from ._traced import traced_under_compile
from ._warn import warn_at_caller
from .buckets import attach_bucket_grads
from .policy import ScalePolicy, check_scale_value


class MinScaleReachedError(RuntimeError):
    """An overflow arrived while the scale was already at ``min_scale`` and
    ``raise_at_min_scale=True`` (DeepSpeed's ``raise_error_at_min_scale``)."""


class GradScaler(ClipMixin):
    """Drop-in replacement for :class:`torch.amp.GradScaler`.

    The positional arguments and defaults are torch's; with them the scale trajectory, growth
    tracker and parameters are bit-identical to torch's scaler. Keyword-only extensions, all
    off by default:

    Args:
        hysteresis: overflows tolerated before backing off (Megatron-core); the tracker
            refills on growth. Int >= 1.
        consecutive_hysteresis: also refill on every clean step (DeepSpeed, apex).
        min_scale: floor of the backoff, finite and >= 0 (0: none, as torch). max_scale: cap of
            the growth.
        raise_at_min_scale: raise :class:`MinScaleReachedError` from :meth:`update` when an
            overflow backs off at ``min_scale``. This reads one flag from the device in
            ``update`` (one host sync), so it is off by default.
        dynamic: ``False`` keeps the scale fixed (static loss scaling); overflows still skip.
        skip_on_overflow: ``False`` takes every step even on overflow (MindSpore's
            ``drop_overflow_update=False``); the scale still backs off when dynamic.
        backend: ``"auto"`` (Triton for CUDA tensors, reference otherwise), ``"reference"``
            or ``"triton"``.
        process_group: found_inf is all-reduced (MAX) over this group before every step
            decision, on both the plain and the fused-optimizer route (sharded gradients).

    Synchronisation: :meth:`scale`, :meth:`unscale_` and :meth:`update` never synchronise;
    :meth:`step` reads one flag for optimizers without ``_step_supports_amp_scaling`` (as
    torch) and none for fused optimizers.
    """

    #: :meth:`unscale_` (and :meth:`clip_grad_norm_`) accept float16 grads: False, as torch's
    #: GradScaler ("Attempting to unscale FP16 gradients."); :class:`ShardedGradScaler`: True.
    _unscales_fp16: bool = False
    #: whether calls from code that torch.compile traces may be traced (module ``_traced``)
    _traceable: bool = True

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float = 0.0,
        max_scale: float = math.inf,
        raise_at_min_scale: bool = False,
        dynamic: bool = True,
        skip_on_overflow: bool = True,
        backend: Backend = "auto",
        process_group: Any = None,
    ) -> None:
        self._policy = ScalePolicy.create(dict(
            growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
            max_scale=max_scale, raise_at_min_scale=raise_at_min_scale, dynamic=dynamic,
            skip_on_overflow=skip_on_overflow))
        init_scale = check_scale_value("init_scale", init_scale, self._policy)
        check_backend(backend)
        check_device(device)
        check_process_group(process_group)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool; got {type(enabled).__name__} {enabled!r}")
        super().__init__(device, init_scale, self._policy.growth_factor,
                         self._policy.backoff_factor, self._policy.growth_interval, enabled)
        self._backend = backend
        self._process_group = process_group
        self._init_extension_state()

    @overload  # torch's overloads: ``scaler.scale(loss).backward()`` type-checks
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]
              ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply outputs (usually the loss) by the scale, as torch's ``scale``.

        The gradient buckets learn that a backward follows (their O(1) check then sees a
        grad that it makes outside its view even after ``zero_grad(set_to_none=False)``).

        Args:
            outputs: a tensor, or a (nested) list / tuple / iterable of tensors.

        Returns:
            The scaled outputs, in the same structure (an iterable that is not a list or
            tuple comes back as a lazy ``map``, as torch's); unscaled when disabled.

        Raises:
            ScaleOutputsError: a string, a dict or a non-tensor leaf (a ``TypeError`` and,
                as torch's error, a ``ValueError``).

        .. note:: Does not synchronise with the host.
        """
        if torch.compiler.is_dynamo_compiling():  # inline, not a decorator: a frame less
            return self._scale_under_compile(outputs)
        if not self._enabled:
            return super().scale(outputs)
        before_backward()
        if isinstance(outputs, torch.Tensor):
            return super().scale(outputs)
        return super().scale(check_outputs(outputs))

    def _scale_under_compile(self, outputs: Any) -> Any:
        """:meth:`scale` from code that torch.compile traces: traced where it can be."""
        if _traced._supported("scale", self, (outputs,), {}):
            return _traced.scale(self, outputs)
        return run_eagerly(GradScaler.scale, self, outputs)

    # ------------------------------------------------------------------ device work
    @eager_under_compile  # as torch's (dynamo skips torch.amp)
    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        """torch's private, same arguments and result (``{device: found_inf}``). A subclass
        may override it (fairscale / fairseq pass ``allow_fp16=True`` to unscale fp16 grads):
        :meth:`unscale_` and :meth:`_check_inf_per_device` then call it as torch's do.
        As torch's, it leaves ``found_inf`` as it is and returns a copy per device."""
        return self._unscale_or_check(optimizer, inv_scale, found_inf, allow_fp16, write=True,
                                      copy_found_inf=True)

    def _overrides_unscale_grads(self) -> bool:
        return type(self)._unscale_grads_ is not GradScaler._unscale_grads_

    def _unscale_or_check(self, optimizer, inv_scale, found_inf, allow_fp16, *, write,
                          copy_found_inf=False):
        """Group the optimizer's grads by (device, dtype), as torch does, and run one fused op
        per group and one per gradient bucket. ``inv_scale`` None: the kernels form it from
        the scale. Returns found_inf per device: ``found_inf`` itself on its device, or
        (``copy_found_inf``) copies of it, as torch's ``_MultiDeviceReplicator``."""
        from_scale = inv_scale is None
        per_device_inv_scale = PerDevice(self._scale if from_scale else inv_scale)
        per_device_found_inf = (_MultiDeviceReplicator if copy_found_inf else PerDevice)(found_inf)
        # torch.no_grad() as torch's _unscale_grads_, through the C call that torch's
        # set_grad_enabled makes: the context manager's Python machinery costs ~20 us a step
        # with cold caches, set_grad_enabled's own object a few
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            groups, mesh_groups = grad_groups(optimizer, allow_fp16, self._backend)
            if write and len(groups) > 1:
                refuse_group_writes(groups, self._backend)
            for group in groups:
                device = group.device
                ops.unscale_group_(group.grads, per_device_found_inf.get(device),
                                   per_device_inv_scale.get(device), self._backend, write,
                                   from_scale=from_scale, group=group)
            if write:
                self._note_written_padding(optimizer, groups)
            if mesh_groups:
                agree_over_meshes(per_device_found_inf._per_device_tensors, mesh_groups)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        if not groups and self._process_group is not None:
            per_device_found_inf.get(found_inf.device)  # no grads here: join the agreement, 0
        return per_device_found_inf._per_device_tensors

    @traced_under_compile(_traced.unscale_)
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's grads in place and record whether any is non-finite.

        One fused launch per gradient bucket and per (device, dtype) group of the other grads.
        Disabled: only GradBuckets' grads are settled (``None`` where no gradient came).

        Args:
            optimizer: the optimizer whose grads to unscale.

        Raises:
            RuntimeError: torch's errors for ``unscale_`` twice before :meth:`update` or after
                :meth:`step`; the ops' errors for grads they refuse (nothing written).
            ValueError: float16 grads (``"Attempting to unscale FP16 gradients."``), as torch.

        .. note:: Does not synchronise with the host.
        """
        if not self._enabled:
            attach_bucket_grads(optimizer)
            return
        state = self._ready_to_unscale(optimizer, "unscale_")
        found_inf = self._found_inf_flag(state)
        if self._overrides_unscale_grads():  # as torch: its inv_scale, through the override
            per_device = self._unscale_grads_(optimizer, reference.inv_scale_of(self._scale),
                                              found_inf, self._unscales_fp16)
        else:  # the kernels form inv_scale from the scale (no extra op)
            per_device = self._unscale_or_check(optimizer, None, found_inf, self._unscales_fp16,
                                                write=True)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED
        if per_device:  # none: torch raises in step(), not here
            self._agree_found_inf(state)

    def _ready_to_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict:
        """The optimizer's per-iteration state; raises torch's errors when its grads were
        already unscaled or stepped in this iteration. Traceable by dynamo (no torch.amp
        method: ``_traced.check_state`` is torch's ``_check_scale_growth_tracker``)."""
        _traced.check_state(self, funcname)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return state

    @traced_under_compile(_traced.check_inf_per_device)
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """Read-only inf/NaN check of the optimizer's grads (the fused-optimizer route)."""
        self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        found_inf = self._found_inf_flag(state)
        if self._overrides_unscale_grads():  # as torch: an unscale by 1.0 through the override
            ones = torch.ones((), dtype=torch.float32, device=self._scale.device)
            written = state.get("written_padding")  # by an unscale_ before: may be NaN
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, ones, found_inf, True)
            if written is None:  # times 1.0: the padding is as it was, zero
                state.pop("written_padding", None)
        else:
            state["found_inf_per_device"] = self._unscale_or_check(optimizer, None, found_inf,
                                                                   True, write=False)
        state.pop("found_inf_agreed", None)
        return state["found_inf_per_device"]

    @traced_under_compile(_traced.step)
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """Unscale (unless :meth:`unscale_` ran) and step the optimizer unless a grad overflowed.

        Fused optimizers (``_step_supports_amp_scaling``) get a read-only check and
        ``grad_scale`` / ``found_inf`` (exactly 0.0 or 1.0); they always step and skip on the
        device.

        Args:
            optimizer: the optimizer to step.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step`` (no ``closure``, as torch).

        Returns:
            ``optimizer.step()``'s return value, or None when the step was skipped.

        Raises:
            RuntimeError: torch's errors for ``step`` twice before :meth:`update` or a
                ``closure`` argument.
            AssertionError: no inf checks were recorded for this optimizer (no grads).

        .. note:: Plain optimizers: one host sync (the flag read torch also makes). Fused
            optimizers: none.
        """
        if not self._enabled:  # GradBuckets: a parameter with no gradient has grad None
            attach_bucket_grads(optimizer)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.UNSCALED:
            attach_bucket_grads(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, *args, **kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _agree_found_inf(self, state: dict[str, Any]):
        """0-d float32 found_inf on the scale's device, exactly 0.0 or 1.0: the max over
        devices, all-reduced (MAX) over ``process_group``. Cached in the optimizer state."""
        agreed = state.get("found_inf_agreed")
        if agreed is not None:
            return agreed
        device = self._scale.device
        values = list(state["found_inf_per_device"].values())
        if not values:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if len(values) > 1 or values[0].device != device:
            values = [t if t.device == device else t.to(device, non_blocking=True)
                      for t in values]
        # One device: the per-device flag itself (a MAX all-reduce in place leaves it 0 / 1).
        agreed = values[0] if len(values) == 1 else torch.stack(values).amax()
        if self._process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._process_group)
            state["found_inf_per_device"] = {agreed.device: agreed}
        state["found_inf_agreed"] = agreed
        return agreed

    def _note_written_padding(self, optimizer: torch.optim.Optimizer, groups: list) -> None:
        """Remember the gradient buckets an unscale wrote in this iteration. A bucket's
        alignment padding (zeros, in no grad) times an ``inv_scale`` that is not finite (a
        scale of 0, NaN, or 2**-128 and below, where its float32 reciprocal overflows) becomes
        NaN, and every later iteration would find it: ``update()`` zeroes the padding again
        (:meth:`_rezero_written_padding`), unless the plain route's host read saw no
        overflow (then ``inv_scale`` was finite and the padding is still zero: no launch)."""
        written = [(group.grads[0], group.padding) for group in groups
                   if group.padding is not None]
        if written:
            self._per_optimizer_states[id(optimizer)]["written_padding"] = written

    def _host_read_span(self, state: dict[str, Any],
                        agreed: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A device tensor holding the scale at 0 and ``agreed`` at the returned index: a
        prefix of the [scale, flags...] buffer when ``agreed`` is one of its flags (no op),
        else a stack of the two."""
        index = self._buffer_index(state, agreed)
        if index and self._host_spans:  # none: the state was made in traced code
            return self._host_spans[index], index
        return torch.stack([self._scale.to(agreed.device), agreed]), 1

    @eager_under_compile  # as torch's (dynamo skips torch.amp)
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> float | None:
        if not self._policy.skip_on_overflow:
            return optimizer.step(*args, **kwargs)
        agreed = self._agree_found_inf(optimizer_state)
        span, index = self._host_read_span(optimizer_state, agreed)
        values = span.tolist()  # the one host sync of the plain route, as torch's item()
        if not values[index]:
            optimizer_state.pop("written_padding", None)  # no overflow: padding still zero
            return optimizer.step(*args, **kwargs)
        self._warn_if_underflowed(values[0])
        return None

    def _fused_step(self, optimizer, state, *args, **kwargs):
        if step_takes_grad_scaler(optimizer):
            warn_at_caller(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.", FutureWarning)
            retval = optimizer.step(*args, **kwargs, grad_scaler=self)
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        elif not state["found_inf_per_device"] and any(
                p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            # unscale_() saw no grads, backward made some since: torch hands the optimizer
            # found_inf=0 (an int) and no grad_scale, and torch's fused optimizers fail
            # ("'int' object has no attribute 'device'"); the plain route's error instead
            raise AssertionError("No inf checks were recorded for this optimizer.")
        scale = self._get_scale_async()
        own = getattr(optimizer, "grad_scale", None)
        if state["stage"] is OptState.UNSCALED:
            optimizer.grad_scale = own
        else:  # the scale itself when the optimizer has none of its own (torch: scale * 1)
            optimizer.grad_scale = scale if own is None else scale * own
        if state["found_inf_per_device"] and self._policy.skip_on_overflow:
            optimizer.found_inf = self._agree_found_inf(state)
        else:  # no grads (torch hands the optimizer 0), or steps are never skipped
            optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        del optimizer.grad_scale
        del optimizer.found_inf
        return retval

    @traced_under_compile(_traced.update)
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's overflow flags, on the device.

        torch's rule plus hysteresis, min / max scale and static scaling, in one launch; also
        records :attr:`last_step_skipped` and :attr:`skipped_steps`.

        Args:
            new_scale: set the scale to this value instead, as torch's (a number is checked
                as ``init_scale``; a tensor is taken as it is).

        Raises:
            MinScaleReachedError: with ``raise_at_min_scale=True``, an overflow backed off at
                ``min_scale`` (raised after the update is complete).
            ValueError, TypeError: a bad numeric ``new_scale`` (nothing changed).
            AssertionError: no inf checks were recorded in this iteration, as torch.

        .. note:: Does not synchronise with the host, except with
            ``raise_at_min_scale=True`` (one flag read).
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        flags = self._flags
        assert flags is not None  # made with the scale
        self._rezero_written_padding()
        if new_scale is not None:
            if not isinstance(new_scale, torch.Tensor):  # torch's checks for a tensor
                new_scale = check_scale_value("new_scale", new_scale, self._policy)
                scale.fill_(new_scale)
            else:
                super().update(new_scale)
            flags.zero_()
            self._reset_iteration()
            return
        states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        if not states:
            raise AssertionError("No inf checks were recorded prior to update.")
        extra = self._found_slot(-1)
        for state in states:
            agreed = self._agree_found_inf(state)
            if not self._buffer_index(state, agreed):
                # rare (a ninth optimizer, several devices): fold it into the last flag
                torch.maximum(extra, (agreed != 0).float(), out=extra)
        policy = self._policy
        at_min_scale = policy.dynamic and policy.raise_at_min_scale \
            and self._backs_off_at_min_scale(flags)
        # One launch: combine the flags, record the skip, update the scale, zero the flags.
        self._bound_update(scale, growth_tracker)()
        self._reset_iteration()
        if at_min_scale:  # raised after the update is complete: the scaler stays usable
            raise MinScaleReachedError(
                f"Current loss scale already at minimum ({policy.min_scale}) - cannot decrease "
                "scale anymore (raise_at_min_scale=True). The step was skipped and the update "
                "is complete; the scaler can go on if this error is caught.")

    def _bound_update(self, scale: torch.Tensor, growth_tracker: torch.Tensor
                      ) -> Callable[[], None]:
        """update()'s device work (``ops.bind_scaler_update``), bound once and kept while the
        policy, the backend and each state tensor it uses are the same objects (compared by
        identity: an integrator's new ``_scale`` is seen)."""
        flags, skipped, count = self._flags, self._last_step_skipped_bytes, self._skipped_steps_t
        if skipped is None:  # viewed once (see ScalerStateMixin._init_device_state)
            assert self._last_step_skipped is not None  # made with the scale
            skipped = self._last_step_skipped_bytes = self._last_step_skipped.view(torch.uint8)
        uses = (self._policy, self._backend, scale, growth_tracker, flags,
                self._hysteresis_tracker_state, skipped, count, self._params_t)
        bound = self._update_bound
        if bound is not None and all(map(operator.is_, uses, bound[0])):
            return bound[1]
        assert flags is not None and skipped is not None and count is not None  # with the scale
        call = ops.bind_scaler_update(scale, growth_tracker, flags, self._policy,
                                      hysteresis_tracker=self._hysteresis_tracker_t,
                                      skipped=skipped, skipped_count=count,
                                      backend=self._backend, params=self._params_t)
        self._update_bound = (uses, call)
        return call

    def _backs_off_at_min_scale(self, flags: torch.Tensor) -> bool:
        """Whether this iteration's overflow backs off with the scale already at
        ``min_scale`` (one host read, documented on ``raise_at_min_scale``)."""
        backs_off = (flags != 0).any()
        if self._hysteresis_tracker_t is not None:
            backs_off = backs_off & (self._hysteresis_tracker_t <= 1)
        return bool((backs_off & (self._scale <= self._policy.min_scale)).item())
