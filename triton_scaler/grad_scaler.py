"""``triton_scaler.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose device work runs in
fused Triton kernels (or the bit-exact PyTorch reference path), with the extensions of
Megatron-core, DeepSpeed, apex and MindSpore scalers.

Each call is written once and runs the same eagerly and under ``torch.compile``: collecting
the grads (:func:`._grads.collect_grads`) and dispatching device work (:mod:`._dispatch`)
are the seams where the two differ; host work that traced code must not contain (an
optimizer's own step with attributes set on it, the plain route's host read, the gradient
buckets' records) runs in eager frames (:mod:`._compile`). What cannot be traced runs
eagerly, a graph break (:func:`_can_trace`).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import torch
from torch.amp.grad_scaler import OptState

from . import reference
from ._arguments import check_device, check_outputs, check_process_group, refuse_non_optimizer
from ._backend import Backend, check_backend, resolve_backend
from ._bucket import attach_bucket_grads, attach_grads_of, buckets_of
from ._clip import check_clip_arguments, clip_unscaled, fused_clip, raise_nonfinite
from ._compile import eager_frame, never_traced, own_code, run_eagerly
from ._dispatch import note_backward, scaler_update, unscale_group
from ._distributed import agree_over_meshes
from ._grads import PerDevice, collect_grads
from ._state import FOUND_INF_SLOTS, ScalerState
from ._step import step_takes_grad_scaler
from ._warn import warn_at_caller
from .policy import ScalePolicy, check_scale_value
from .spike_guard import SpikeGuard
from .telemetry import GradWatch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _can_trace(scaler: GradScaler, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``scaler.<name>(*args, **kwargs)`` from code that dynamo traces is
    traced; otherwise it runs eagerly (a graph break). Not traced: a scaler with a
    ``process_group`` (:class:`ShardedGradScaler` always has one), ``raise_at_min_scale=True``
    or a subclass's own ``_unscale_grads_``; grads that are tensor subclasses (DTensor) or
    sparse; ``scale`` of anything but tensors in (nested) lists and tuples;
    ``clip_grad_norm_`` of a disabled scaler, with ``error_if_nonfinite=True``,
    ``sharded=True``, a ``norm_type`` other than 2 and inf, or over GradBuckets on the Triton
    backend (the eager clip reads a bucket's buffer in one launch, whose norm partials a
    traced loop over the grads would not reproduce bit for bit); with a watch that checks
    every ``check_every`` updates (a host read)."""
    if not scaler._traceable or scaler._process_group is not None or \
            scaler._policy.raise_at_min_scale or scaler._overrides_unscale_grads() or \
            scaler._watch is not None and scaler._watch.check_every is not None:
        return False
    if name == "update":
        return True
    if name == "scale":
        return _lists_of_tensors(args[0] if args else kwargs.get("outputs"))
    optimizer = args[0] if args else kwargs.get("optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) or not _plain_grads(optimizer):
        return False
    if name == "clip_grad_norm_":
        norm_type = args[2] if len(args) > 2 else kwargs.get("norm_type", 2.0)
        if not scaler._enabled or len(args) > 3 or kwargs.get("error_if_nonfinite") or \
                kwargs.get("sharded") or type(norm_type) not in (int, float) or \
                norm_type not in (2.0, math.inf):
            return False
        for bucket in buckets_of(optimizer):
            if resolve_backend(scaler._backend, bucket.device) == "triton":
                return False
    return True


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _traced() -> bool:
    """Whether dynamo traces the caller, as a function of this package: where dynamo runs a
    decorated call's frame itself after a graph break, it compiles this frame (torch's own
    ``is_dynamo_compiling``, in a module dynamo skips, it would not: False, and the call's
    body would be traced frame by frame instead of running eagerly)."""
    return torch.compiler.is_dynamo_compiling()


def traced_when(can_trace: Callable[..., bool]) -> Callable[[_Method], _Method]:
    """Decorate a scaler method: traced code runs the method itself (the same body as in
    eager code) when ``can_trace(self, name, args, kwargs)``, else the method eagerly (a graph
    break; an error under ``fullgraph=True``). Eager code calls the method directly."""

    def decorate(method: _Method) -> _Method:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if _traced() and not can_trace(self, name, args, kwargs):
                return run_eagerly(method, self, *args, **kwargs)
            return method(self, *args, **kwargs)
        return cast(_Method, own_code(wrapper, method))
    return decorate


def _lists_of_tensors(outputs: Any) -> bool:
    if isinstance(outputs, torch.Tensor):
        return True
    if not isinstance(outputs, (list, tuple)):
        return False
    for item in outputs:  # a loop: torch 2.8's dynamo cannot inline all(...) here
        if not _lists_of_tensors(item):
            return False
    return True


def _plain_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every grad of ``optimizer`` is a dense, plain tensor."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None and (type(grad) is not torch.Tensor or grad.is_sparse):
                return False
    return True


def fresh_optimizer_state() -> dict[str, Any]:
    """An optimizer's state at the start of an iteration, as torch's
    ``_refresh_per_optimizer_state`` (ours: code that dynamo traces may call it)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _refuse_scale_settings(**given: tuple[Any, Any]) -> None:
    """``scaling=False`` keeps the scale at 1.0: ``ValueError`` naming a scale setting given
    another value than its default."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise ValueError(f"{name}={value!r} sets the loss scale, and scaling=False keeps "
                             "it at 1.0 (the guard-only mode): leave it out")


def _cuda_definitely_unavailable() -> bool:
    """torch's own test for its "CUDA is not available" warning (no CUDA, no torch_xla)."""
    return torch.cuda.amp.common.amp_definitely_not_available()


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return True
    return False


@eager_frame
def _fused_optimizer_step(optimizer: torch.optim.Optimizer, scale: torch.Tensor | None,
                          found_inf: torch.Tensor, args: tuple, kwargs: dict,
                          checked_now: bool) -> Any:
    """A fused optimizer's step with ``grad_scale`` / ``found_inf`` set on it, as torch's
    scaler does (``scale`` None: the grads were unscaled, the optimizer's own ``grad_scale``
    is kept; else the product with it). An eager frame: attributes set on the optimizer in
    traced code would not reach a step that dynamo does not trace. ``checked_now``: the
    step's own check ran just before (see :func:`attach_grads_of`)."""
    # GradBuckets: grad None where no gradient came, as torch
    attach_bucket_grads(optimizer, checked_now)
    fused: Any = optimizer  # torch's fused contract: attributes the optimizer reads in step
    own = getattr(fused, "grad_scale", None)
    fused.grad_scale = own if scale is None else scale if own is None else scale * own
    fused.found_inf = found_inf
    retval = fused.step(*args, **kwargs)
    del fused.grad_scale
    del fused.found_inf
    return retval


@eager_frame
def _legacy_fused_step(scaler: GradScaler, optimizer: torch.optim.Optimizer, args: tuple,
                       kwargs: dict) -> Any:
    """torch's older fused contract: the optimizer takes the scaler (``grad_scaler=``), with
    torch's FutureWarning."""
    _warn_legacy_fused_step()
    attach_bucket_grads(optimizer)
    legacy: Any = optimizer  # its step takes ``grad_scaler=``
    return legacy.step(*args, **kwargs, grad_scaler=scaler)


@never_traced
def _warn_legacy_fused_step() -> None:
    warn_at_caller(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
        "directly.", FutureWarning)


@eager_frame
def _disabled_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    attach_bucket_grads(optimizer)  # GradBuckets: a parameter with no gradient has grad None
    return optimizer.step(*args, **kwargs)


class MinScaleReachedError(RuntimeError):
    """An overflow arrived while the scale was already at ``min_scale`` and
    ``raise_at_min_scale=True`` (DeepSpeed's ``raise_error_at_min_scale``)."""


class GradScaler(ScalerState):
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
    #: whether calls from code that torch.compile traces may be traced (:func:`_can_trace`)
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
        spike_guard: SpikeGuard | None = None,
        scaling: bool = True,
    ) -> None:
        if not isinstance(scaling, bool):
            raise TypeError(f"scaling must be a bool; got {type(scaling).__name__} {scaling!r}")
        if not scaling:  # the guard-only mode: scale 1.0, fixed; checks read the grads only
            _refuse_scale_settings(init_scale=(init_scale, 2.0**16),
                                   growth_factor=(growth_factor, 2.0),
                                   backoff_factor=(backoff_factor, 0.5),
                                   growth_interval=(growth_interval, 2000),
                                   dynamic=(dynamic, True), hysteresis=(hysteresis, 1),
                                   consecutive_hysteresis=(consecutive_hysteresis, False),
                                   min_scale=(min_scale, 0.0), max_scale=(max_scale, math.inf),
                                   raise_at_min_scale=(raise_at_min_scale, False))
            init_scale, dynamic = 1.0, False
            self._unscales_fp16 = True  # nothing is unscaled: fp16 grads are only read
        self._scaling = scaling
        if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
            raise TypeError(f"spike_guard must be a SpikeGuard or None; got "
                            f"{type(spike_guard).__name__}")
        if spike_guard is not None and spike_guard.skips and skip_on_overflow is False:
            raise ValueError("spike_guard with action='skip' skips steps, and "
                             "skip_on_overflow=False says steps are never skipped: use "
                             "action='clip', or skip_on_overflow=True")
        self._guard = spike_guard
        self._guarded = False  # whether this iteration's clip ran the guard
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
        if enabled and device == "cuda" and _cuda_definitely_unavailable():
            warn_at_caller(
                "triton_scaler.GradScaler('cuda') is enabled, but CUDA is not available: the "
                "scaler is disabled (scale() returns its outputs unchanged, step() steps "
                "without unscaling). Pass device='cpu' to scale losses under CPU autocast, or "
                "enabled=False to say so.", UserWarning)
            enabled = False
        super().__init__(device, init_scale, self._policy.growth_factor,
                         self._policy.backoff_factor, self._policy.growth_interval, enabled)
        self._backend = backend
        self._process_group = process_group
        self._per_optimizer_states = defaultdict(fresh_optimizer_state)
        self._init_extension_state()

    @overload  # torch's overloads: ``scaler.scale(loss).backward()`` type-checks
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    @traced_when(_can_trace)
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
        if not self._enabled:
            return outputs
        note_backward(self._backward_token)
        if not self._scaling:  # the guard-only mode: the outputs as they are
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(
                    outputs.device if isinstance(outputs, torch.Tensor) else self._home())
            return outputs if isinstance(outputs, torch.Tensor) else check_outputs(outputs)
        if isinstance(outputs, torch.Tensor):  # torch's arithmetic
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        return self._scaled(check_outputs(outputs), [])

    def _scaled(self, value: Any, per_device: list[PerDevice]) -> Any:
        """torch's ``apply_scale``: tensors times the scale (copied once per device), lists
        and tuples rebuilt, other iterables mapped lazily."""
        if isinstance(value, torch.Tensor):
            if not per_device:
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(value.device)
                per_device.append(PerDevice(self._scale))
            return value * per_device[0].get(value.device)
        if isinstance(value, (list, tuple)):
            return type(value)(self._scaled(item, per_device) for item in value)
        return map(lambda item: self._scaled(item, per_device), value)

    # ------------------------------------------------------------------ device work
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
        inv_for = PerDevice(self._scale if from_scale else inv_scale)
        found_for = PerDevice(found_inf, copies=copy_found_inf)
        # torch.no_grad() as torch's _unscale_grads_, through the C call that torch's
        # set_grad_enabled makes, without the context manager's Python machinery (host time
        # every step, the more with the host's caches cold)
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            groups, mesh_groups = collect_grads(optimizer, allow_fp16, self._backend, write)
            if self._watch is not None:  # its read pass, before the grads are written
                self._watch._observe(optimizer, reference.inv_scale_of(self._scale)
                                     if from_scale else inv_scale)
            for group in groups:
                device = group.device
                unscale_group(group, found_for.get(device), inv_for.get(device),
                              self._backend, write, from_scale=from_scale,
                              strict=not self._scaling)
            if write:
                self._note_written_padding(optimizer, groups)
            if mesh_groups:
                agree_over_meshes(found_for.per_device, mesh_groups)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        if not groups and self._process_group is not None:
            found_for.get(found_inf.device)  # no grads here: join the agreement, 0
        return found_for.per_device

    @traced_when(_can_trace)
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
        if not hasattr(optimizer, "param_groups"):
            refuse_non_optimizer(optimizer, "unscale_")
        if not self._enabled:
            if buckets_of(optimizer):
                attach_bucket_grads(optimizer)
            return
        state = self._ready_to_unscale(optimizer, "unscale_")
        found_inf = self._found_inf_flag(state)
        if self._overrides_unscale_grads():  # as torch: its inv_scale, through the override
            if self._watch is not None:
                self._watch_grads(optimizer)
            per_device = self._unscale_grads_(optimizer, reference.inv_scale_of(self._scale),
                                              found_inf, self._unscales_fp16)
        else:  # the kernels form inv_scale from the scale (no extra op)
            per_device = self._unscale_or_check(optimizer, None, found_inf, self._unscales_fp16,
                                                write=self._scaling)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED
        if per_device:  # none: torch raises in step(), not here
            self._agree_found_inf(state)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This iteration's overflow flag for ``optimizer``'s grads, the one :meth:`step` reads.

        Where :meth:`unscale_` found no grads to check (a frozen part, a loss that reaches none
        of the optimizer's parameters), a zero flag is recorded: the iteration is then clean
        for this optimizer's :meth:`step` and for :meth:`update` (torch's scaler raises "No
        inf checks were recorded" there).

        Args:
            optimizer: an optimizer that :meth:`unscale_` (or :meth:`clip_grad_norm_`) saw in
                this iteration.

        Returns:
            A 0-d float32 tensor on the scale's device, exactly 0.0 or 1.0, agreed over
            ``process_group``. :meth:`update` zeroes it: clone it to keep it.

        Raises:
            RuntimeError: :meth:`unscale_` has not run for ``optimizer`` since :meth:`update`.

        .. note:: Does not synchronise with the host.
        """
        state = self._per_optimizer_states.get(id(optimizer))
        if state is None or state["stage"] is not OptState.UNSCALED:
            raise RuntimeError("found_inf() needs unscale_(optimizer) (or clip_grad_norm_) "
                               "first in this iteration")
        if not state["found_inf_per_device"]:
            flag = self._found_inf_flag(state)
            state["found_inf_per_device"] = {flag.device: flag}
        return self._agree_found_inf(state)

    def _found_inf_flag(self, state: dict[str, Any]) -> torch.Tensor:
        """A zeroed 0-d float32 found_inf for this optimizer's iteration, on the scale's
        device: its own slot of the flag buffer (the same one again, re-zeroed, if it asks
        twice), or a fresh tensor past the slots."""
        flag = state.get("found_inf_slot")
        if flag is not None:  # checked twice in one iteration: start again from 0
            return flag.zero_()
        index = 0  # its position in the [scale, flags...] buffer; 0: not in it
        if self._slots_taken < FOUND_INF_SLOTS - 1:
            slots = self._found_slots  # made once: the method only for state made traced
            flag = slots[self._slots_taken] if slots else self._found_slot(self._slots_taken)
            self._slots_taken += 1
            index = self._slots_taken
        else:  # update() folds it into the last slot
            flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        state["found_inf_slot"] = flag
        state["found_inf_index"] = index
        return flag

    def _found_slot(self, index: int) -> torch.Tensor:
        """The ``index``-th found_inf flag, a view of :attr:`_flags`: made once in eager code;
        in code that torch.compile traces, made where it is used when the state was made
        there too (see :meth:`_init_device_state`)."""
        slots = self._found_slots
        if not slots:
            assert self._flags is not None  # made with the scale
            return self._flags[index]
        return slots[index]

    @staticmethod
    def _buffer_index(state: dict[str, Any], agreed: torch.Tensor) -> int:
        """Where ``agreed`` sits in the [scale, flags...] buffer: its slot's position when it
        is the optimizer's own slot, 0 when it is another tensor (several devices, past the
        slots)."""
        return state.get("found_inf_index", 0) if agreed is state.get("found_inf_slot") else 0

    def _reset_iteration(self) -> None:
        """Forget this iteration's per-optimizer states; the flags are zero again."""
        self._per_optimizer_states = defaultdict(fresh_optimizer_state)
        self._slots_taken = 0
        self._guarded = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # also a pickle of an earlier version: torch's factory (dynamo cannot call it)
        self._per_optimizer_states = defaultdict(fresh_optimizer_state,
                                                 self._per_optimizer_states)

    def _ready_to_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict:
        """The optimizer's per-iteration state; raises torch's errors when its grads were
        already unscaled or stepped in this iteration."""
        if self._scale is None or self._growth_tracker is None:
            self._check_state(funcname)  # raises torch's error
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
                + (" clip_grad_norm_() unscales the grads (it counts as this iteration's "
                   "unscale_()): call one of the two per optimizer and iteration."
                   if state.get("unscaled_by_clip") else ""))
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return state

    @traced_when(_can_trace)
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """Read-only inf/NaN check of the optimizer's grads (the fused-optimizer route)."""
        self._check_state("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        found_inf = self._found_inf_flag(state)
        if self._overrides_unscale_grads():  # as torch: an unscale by 1.0 through the override
            if self._watch is not None:
                self._watch_grads(optimizer)
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

    @traced_when(_can_trace)
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
        if not hasattr(optimizer, "param_groups"):
            refuse_non_optimizer(optimizer, "step")
        if not self._enabled:
            return _disabled_step(optimizer, args, kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_state("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = self._fused_step(optimizer, state, args, kwargs)
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            if len(state["found_inf_per_device"]) == 0:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _fused_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    args: tuple, kwargs: dict) -> Any:
        """The fused-optimizer route: a read-only check (unless ``unscale_`` ran), then the
        optimizer's own step with ``grad_scale`` / ``found_inf`` (exactly 0.0 or 1.0)."""
        if step_takes_grad_scaler(optimizer):
            return _legacy_fused_step(self, optimizer, args, kwargs)
        checked_now = state["stage"] is OptState.READY
        if checked_now:
            self._check_inf_per_device(optimizer)
        elif not state["found_inf_per_device"] and _has_grads(optimizer):
            # unscale_() saw no grads, backward made some since: torch hands the optimizer
            # found_inf=0 (an int) and no grad_scale, and torch's fused optimizers fail
            # ("'int' object has no attribute 'device'"); the plain route's error instead
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if state["found_inf_per_device"] and self._policy.skip_on_overflow:
            found_inf = self._step_flag(state)
        else:  # no grads (torch hands the optimizer 0), or steps are never skipped
            found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        unscaled = state["stage"] is OptState.UNSCALED or not self._scaling
        return _fused_optimizer_step(optimizer, None if unscaled else self._scale, found_inf,
                                     args, kwargs, checked_now)

    def _step_flag(self, state: dict[str, Any]) -> torch.Tensor:
        """Whether the optimizer's step is skipped (0-d float32, 0.0 or 1.0): the agreed
        found_inf, or with a skipping spike guard its clip's flag (an overflow or a spike)."""
        flag = state.get("skip_flag")
        return flag if flag is not None else self._agree_found_inf(state)

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
        NaN, and every later iteration would find it. The plain route's host read decides:
        no overflow, ``inv_scale`` was finite and the padding is still zero (no launch); an
        overflow, the padding is zeroed again there. Otherwise ``update()`` zeroes it
        (:meth:`_rezero_written_padding`)."""
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

    @eager_frame  # the optimizer's own step is traced as usual, as under torch's scaler
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> float | None:
        if self._skips_step(optimizer, optimizer_state):
            return None
        return optimizer.step(*args, **kwargs)

    @never_traced
    def _skips_step(self, optimizer: torch.optim.Optimizer,
                    optimizer_state: dict[str, Any]) -> bool:
        """The plain route's decision: the one host read (as torch's ``item()``) of the
        agreed found_inf, unless steps are never skipped."""
        attach_grads_of(optimizer)  # GradBuckets: grad None where no gradient came, as torch
        if not self._policy.skip_on_overflow:
            return False
        agreed = self._step_flag(optimizer_state)
        span, index = self._host_read_span(optimizer_state, agreed)
        values = span.tolist()  # the one host sync of the plain route, as torch's item()
        written = optimizer_state.pop("written_padding", ())  # no overflow: still zero
        if not values[index]:
            return False
        for buffer, padding in written:  # now, not in update(): its state is the same each step
            buffer.index_fill_(0, padding, 0)
        self._warn_if_underflowed(values[0])
        return True

    @traced_when(_can_trace)
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
        scale, growth_tracker = self._check_state("update")
        flags = self._flags
        assert flags is not None  # made with the scale
        self._rezero_written_padding()
        if new_scale is not None:
            if not isinstance(new_scale, torch.Tensor):
                new_scale = check_scale_value("new_scale", new_scale, self._policy)
                scale.fill_(new_scale)
            else:  # torch's checks for a tensor
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                assert new_scale.device.type == self._device, reason
                assert new_scale.numel() == 1, reason
                assert new_scale.requires_grad is False, reason
                scale.copy_(new_scale)
            flags.zero_()
            guard = None if self._guard is None else self._guard.skip_statistics()
            if guard is not None:  # a spike of this iteration is forgotten too
                guard[4].zero_()
            self._reset_iteration()
            return
        states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        if not states:
            raise AssertionError("No inf checks were recorded prior to update.")
        extra = self._found_slot(FOUND_INF_SLOTS - 1)
        for state in states:
            agreed = self._agree_found_inf(state)
            if not self._buffer_index(state, agreed):
                # rare (a ninth optimizer, several devices): fold it into the last flag
                extra.copy_(torch.maximum(extra, (agreed != 0).float()))
        policy = self._policy
        at_min_scale = policy.dynamic and policy.raise_at_min_scale \
            and self._backs_off_at_min_scale(flags)
        # One launch: combine the flags, record the skip, update the scale, zero the flags.
        assert self._last_step_skipped is not None and self._skipped_steps_t is not None
        assert self._params_t is not None  # made with the scale
        scaler_update(scale, growth_tracker, flags, policy,
                      hysteresis_tracker=self._hysteresis_tracker_t,
                      skipped=self._last_step_skipped, skipped_count=self._skipped_steps_t,
                      skipped_bytes=self._last_step_skipped_bytes, params=self._params_t,
                      backend=self._backend, watch=self._watch,
                      guard=None if self._guard is None else self._guard.skip_statistics())
        self._reset_iteration()
        if self._watch is not None:
            self._watch._updated()
        if at_min_scale:  # raised after the update is complete: the scaler stays usable
            raise MinScaleReachedError(
                f"Current loss scale already at minimum ({policy.min_scale}) - cannot decrease "
                "scale anymore (raise_at_min_scale=True). The step was skipped and the update "
                "is complete; the scaler can go on if this error is caught.")

    def _backs_off_at_min_scale(self, flags: torch.Tensor) -> bool:
        """Whether this iteration's overflow backs off with the scale already at
        ``min_scale`` (one host read, documented on ``raise_at_min_scale``)."""
        backs_off = (flags != 0).any()
        if self._hysteresis_tracker_t is not None:
            backs_off = backs_off & (self._hysteresis_tracker_t <= 1)
        return bool((backs_off & (self._scale <= self._policy.min_scale)).item())

    # ------------------------------------------------------------------ telemetry
    def _watch_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """The watch records ``optimizer``'s grads before they are unscaled or checked
        (every route: ``unscale_``, the fused clip, the fused route's check)."""
        self._watch._observe(optimizer, reference.inv_scale_of(self._scale))

    def unscaled(self, values: Any) -> Any:
        """``values`` divided by the scale: a loss that was scaled (the losses a pipeline
        schedule returns through a scaled ``loss_fn``), for logging. Call it before
        :meth:`update`, which may change the scale.

        Args:
            values: a tensor, or a list / tuple of tensors (returned in kind).

        Returns:
            The unscaled values (exact for power-of-two scales; before the scale is made, by
            the scale it will be made at); ``values`` itself when disabled or in the
            guard-only mode.

        .. note:: Does not synchronise with the host.
        """
        if not self._enabled or not self._scaling:
            return values
        if isinstance(values, torch.Tensor):
            scale = self._scale
            return values / (self._init_scale if scale is None else scale.to(values.device))
        return type(values)(self.unscaled(value) for value in values)

    def watch(self, model: Any, *, max_consecutive_skips: int | None = None,
              check_every: int | None = None) -> GradWatch:
        """Watch the gradients of ``model``'s parameters: per-parameter norm, amax and inf /
        NaN counts of the unscaled gradients, overflows named by parameter, and the run of
        skipped steps, recorded by this scaler's own calls (see docs/telemetry.md).

        Args:
            model: an ``nn.Module``, or ``(name, parameter)`` pairs (``named_parameters()``).
            max_consecutive_skips: raise :class:`SkippedStepsError` (from
                :meth:`GradWatch.report`) when more steps than this were skipped in a row.
            check_every: also check every this many ``update()`` calls (one host read then).

        Returns:
            The :class:`GradWatch`; :meth:`GradWatch.report` reads it.

        Raises:
            TypeError: ``model`` has no named parameters.
            RuntimeError: this scaler already has a watch (``close()`` it first).

        .. note:: Does not synchronise with the host; nor do the calls it watches.
        """
        if self._watch is not None:
            raise RuntimeError("this scaler already has a watch; call its close() before "
                               "watching again")
        watch = GradWatch(model, max_consecutive_skips, check_every, backend=self._backend,
                          process_group=self._process_group,
                          scale_and_skips=self._scale_and_skips, on_close=self._unwatch)
        self._watch = watch
        return watch

    def _scale_and_skips(self, device: torch.device | None) -> torch.Tensor:
        """What a watch's report reads: float64 ``(spikes, last spike's norm, threshold and
        step, scale, skipped steps)`` on ``device`` (None: the scale's), the device values
        once made (the spikes: a guard's, zeros without one), else the host's (1.0 and the
        saved count when disabled). No host sync."""
        if self._enabled and self._scale is not None:
            assert self._skipped_steps_t is not None  # made with the scale
            spikes = None if self._guard is None else self._guard.spike_record()
            values = torch.stack([self._scale.double().reshape(()),
                                  self._skipped_steps_t.double().reshape(())])
            values = torch.cat([values.new_zeros(4) if spikes is None
                                else spikes.to(values.device), values])
            return values if device is None else values.to(device)
        return torch.tensor([0.0] * 4 + [self.get_scale(), float(self.skipped_steps)],
                            dtype=torch.float64, device=device or "cpu")

    def _unwatch(self) -> None:
        self._watch = None

    # ------------------------------------------------------------------ clipping
    @traced_when(_can_trace)
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float | str = 2.0, error_if_nonfinite: bool = False, *,
                        sharded: bool | ProcessGroup | None = None) -> torch.Tensor:
        """Unscale the optimizer's grads and clip them by their total norm, in one read pass
        and one read + write pass (torch's ``unscale_`` + ``clip_grad_norm_`` make five).

        Counts as this iteration's :meth:`unscale_` for ``optimizer`` (``step`` skips on
        overflow; a later ``unscale_`` raises, as torch). Returns the total norm of the
        unscaled grads as a 0-d float32 tensor on the scale's device, accumulated in float32
        (also for bf16 / fp16 grads; float64 with float64 grads, whose clip coefficient is
        formed from the float64 norm, as torch's). ``norm_type`` 2 and ``inf`` (or
        ``"inf"``) run fused; other ``p > 0`` run as ``unscale_`` + a clip, as does a
        subclass that overrides ``_unscale_grads_``. No host sync, except
        ``error_if_nonfinite=True`` (one read). A disabled scaler clips with torch's
        ``clip_grad_norm_``. No grads: as torch, a 0 norm and nothing recorded (``step`` then
        raises). Sparse grads raise, as in torch.

        Whose norm (every rank calls this; the reductions are collective): DTensor grads
        (FSDP2, tensor parallel) give the global norm over their mesh, as torch's clip.
        Plain grads: ``sharded=False`` (or no ``process_group``), the norm of this rank's
        grads, as torch's clip (DDP, whose grads are already reduced); ``sharded=True``, they
        are shards of one gradient over the scaler's ``process_group`` (FSDP1 with a sharded
        strategy, ZeRO-style sharding) and the norm is summed over it, as
        ``FullyShardedDataParallel.clip_grad_norm_``. With a ``process_group`` and plain
        grads, ``sharded`` must be given. ``sharded=<group>``: this rank's norm (its own
        reductions done: DTensor grads over their mesh) is summed over the ranks of that
        group, which hold different parameters: the pipeline-parallel group (``mesh["pp"]``),
        so that every stage gets the whole model's norm (not the whole world: a
        data-parallel replica's norm would be counted once per replica).

        Args:
            optimizer: the optimizer whose grads to unscale and clip.
            max_norm: the largest total norm, finite and >= 0.
            norm_type: p of the p-norm, > 0, or ``inf`` / ``"inf"``.
            error_if_nonfinite: raise when the total norm is non-finite, as torch's clip.
            sharded: whether plain grads are shards over the scaler's ``process_group``; or
                a process group over which each rank's norm is summed (pipeline stages).

        Returns:
            The total norm of the unscaled grads, a 0-d float32 tensor on the scale's device.

        Raises:
            RuntimeError: a non-finite norm with ``error_if_nonfinite=True``; torch's errors
                for a second unscale in one iteration.
            ValueError, TypeError: a bad argument, named; ``sharded`` missing where needed.
            NotImplementedError: sparse grads.

        .. note:: Does not synchronise with the host, except ``error_if_nonfinite=True``
            (one read).
        """
        if not hasattr(optimizer, "param_groups"):
            refuse_non_optimizer(optimizer, "clip_grad_norm_")
        max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"error_if_nonfinite must be a bool; got {error_if_nonfinite!r}")
        if not self._enabled:  # GradBuckets: grad None where no gradient came (as unscale_)
            attach_bucket_grads(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        shard_group, stages = self._shard_group(params, sharded)
        if any(p.grad.is_sparse for p in params):
            raise NotImplementedError(
                "clip_grad_norm_ takes dense gradients only; a parameter has a sparse one "
                "(torch.nn.utils.clip_grad_norm_ does not take them either)")
        guard = self._guard if self._enabled else None
        if guard is not None and self._guarded:
            raise RuntimeError("the spike guard takes one clip_grad_norm_ per iteration (its "
                               "statistics are the whole model's norm); this iteration's clip "
                               "already ran it: clip every optimizer's grads in one call, or "
                               "call update() first")
        whole = shard_group is None and stages is None  # this rank's grads are the model's
        if not self._enabled and whole:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite).float()
        if not self._enabled:
            device = params[0].grad.device if params else torch.device("cpu")
            return clip_unscaled(params, max_norm, norm_type, shard_group, device,
                                 error_if_nonfinite, stages=stages)
        if norm_type not in (2.0, math.inf) or (not params and whole) or \
                self._overrides_unscale_grads():  # a subclass's own unscale: through it
            self.unscale_(optimizer)  # no grads: as torch, unscale_ records none, norm 0
            self._per_optimizer_states[id(optimizer)]["unscaled_by_clip"] = True
            device = self._scale.device
            if whole and guard is None:
                total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                       error_if_nonfinite)
                return total.float().to(device)
            total = clip_unscaled(params, max_norm, norm_type, shard_group, device,
                                  error_if_nonfinite, guard, self._backend, stages)
            self._after_guard(optimizer, guard)
            return total
        state = self._ready_to_unscale(optimizer, "unscale_")  # torch's unscale_ errors
        found_for = PerDevice(self._found_inf_flag(state))
        with torch.no_grad():
            groups, mesh_groups = collect_grads(optimizer, self._unscales_fp16, self._backend,
                                                True)
            if self._watch is not None:  # its read pass, before the grads are written
                self._watch_grads(optimizer)
            total, nonfinite = fused_clip(optimizer, groups, mesh_groups, found_for,
                                          self._scale, self._backend, max_norm, norm_type,
                                          shard_group, error_if_nonfinite, guard, stages)
            # a bucket's padding times a NaN coefficient (a non-finite norm: an overflow) or
            # an infinite inv_scale is NaN: zeroed again in update() after an overflow
            self._note_written_padding(optimizer, groups)
        if not groups and self._process_group is not None:
            found_for.get(self._scale.device)  # no grads here: join the agreement with 0
        state["found_inf_per_device"] = found_for.per_device
        state["stage"] = OptState.UNSCALED
        state["unscaled_by_clip"] = True  # named in a later unscale_'s error
        if found_for.per_device:  # none when no grad remained (GradBuckets: none received)
            self._agree_found_inf(state)
        self._after_guard(optimizer, guard)
        if nonfinite:  # as torch: unscaled (recorded as unscale_), not clipped
            raise_nonfinite(norm_type)
        return total

    def _after_guard(self, optimizer: torch.optim.Optimizer, guard: SpikeGuard | None) -> None:
        """After a guarded clip: the iteration's guard step is taken; a skipping guard's
        spike joins the optimizer's overflow in the flag its step reads."""
        if guard is None:
            return
        self._guarded = True
        state = self._per_optimizer_states[id(optimizer)]
        spike = guard.spike()
        if guard.skips and state["found_inf_per_device"] and spike is not None:
            agreed = self._agree_found_inf(state)
            state["skip_flag"] = torch.maximum(agreed, spike.to(agreed.device, torch.float32))

    def _shard_group(self, params: list, sharded: Any) -> tuple[Any, Any]:
        """``(shard group, stage group)``: the group over which plain grads are shards (None:
        they are whole), and the group over which this rank's whole norm is summed (a
        process group passed as ``sharded``: pipeline stages); raises when ``sharded`` is
        none of True, False, None or a process group, or is needed and missing."""
        if sharded is not None and not isinstance(sharded, bool):
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(sharded, dist.ProcessGroup)):
                raise TypeError(f"sharded must be True, False, None or a "
                                f"torch.distributed.ProcessGroup; got {sharded!r}")
            return None, sharded
        group = self._process_group
        if sharded and group is None:
            raise ValueError("sharded=True sums the norm over the scaler's process_group, and "
                             "this GradScaler has none: pass GradScaler(..., process_group=pg)")
        if sharded is None and group is not None and \
                any(type(p.grad) is torch.Tensor for p in params):
            raise ValueError(
                "clip_grad_norm_ with a process_group and plain (not DTensor) grads: pass "
                "sharded=True when each rank's grads are shards of one gradient (FSDP1 with a "
                "sharded strategy, ZeRO-style sharding: the norm is summed over process_group), "
                "sharded=False when every rank holds the whole gradient (DDP: the norm is "
                "this rank's, as torch.nn.utils.clip_grad_norm_), or sharded=<group> to sum "
                "each rank's norm over the ranks of that group (pipeline stages)")
        return (group if sharded else None), None

