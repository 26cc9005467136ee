"""The device boundary: every unscale, check, clip pass and scale update goes through here,
to the Triton kernels or the reference path, and, in code that ``torch.compile`` traces,
through the registered torch ops at the bottom of this module.

This is the dispatch seam of the scaler's calls (:mod:`._compile`): eager code calls the
implementations directly (a registered op costs host microseconds of dispatch per call);
traced code calls the registered ops, which Inductor treats as opaque and which run the same
implementations on real tensors at run time. Either way the same kernels run over the same
plans, so a call gives the same bits eagerly and compiled.

The registered ops (namespace ``triton_scaler``), each returning nothing and mutating what
its schema says, except ``unscale_norm_``, which returns the norm partial:

* ``non_finite_check_and_unscale_(grads, found_inf, inv_scale, backend)``;
* ``non_finite_check_(grads, found_inf, inv_scale, backend)``;
* ``unscale_norm_(grads, found_inf, inv_scale, norm, backend) -> Tensor``: the clip's read
  pass (found_inf, and the sum of squares or max ``|x|`` of the unscaled grads);
* ``unscale_clip_(grads, found_inf, inv_scale, clip_coef, backend)``: the clip's write pass;
* ``update_scale_(scale, growth_tracker, found_inf, hysteresis_tracker, <settings>, backend,
  params)``;
* ``scaler_update_(scale, growth_tracker, flags, hysteresis_tracker, skipped, skipped_count,
  guard, params, <settings>, backend)``: the one launch of :meth:`GradScaler.update`;
* ``before_backward_(token)``: the gradient buckets' host-side note that a backward
  follows; ``token`` is declared mutated so that the op stays in the graph, in order;
* ``watch_stats(grads, inv_scale, backend) -> Tensor``: a watch's statistics of the grads
  (:func:`watch_stats`), mutating nothing;
* ``spike_guard_(stats, settings, norm, zscore, clip_mean, skip, backend)``: a spike guard's
  step (:func:`spike_guard_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.library import custom_op

from . import _backend, _plans, reference
from ._backend import resolve_backend, triton_kernels
from ._bucket import before_backward
from ._compile import is_traced, run_eagerly
from ._distributed import add_groups, agree_over_meshes, local_grad
from ._op_args import (
    PLAIN,
    as_tensor_list,
    check_before_writing,
    check_flag,
    group_grads,
    nested_grad_error,
)
from .policy import ScalePolicy, cached_policy

if TYPE_CHECKING:
    from ._grads import GradGroup

_GUARD_SPIKE = 4  # a spike guard's "spike" (kernels/guard.py's STATS_LAYOUT)


# ---------------------------------------------------------------- the scaler's device work
def unscale_group(group: GradGroup, found_inf: torch.Tensor, scale: torch.Tensor,
                  backend: str, write: bool, *, from_scale: bool = False, norm: int = 0,
                  clip_coef: torch.Tensor | None = None, strict: bool = False
                  ) -> torch.Tensor | None:
    """Unscale (or only check) one :class:`GradGroup` (grads of one device and dtype), with no
    argument checks: the scaler, which groups grads as torch does, guarantees them.

    ``from_scale``: ``scale`` is the scale, whose reciprocal is formed as torch forms it
    (``fp32(1 / fp64(scale))``); else it is ``inv_scale``. ``clip_grad_norm_``'s passes, on the
    Triton backend only: ``norm`` (2 or -1, ``write=False``) returns the group's sum of
    squares (max ``|x|``) of the unscaled grads; ``clip_coef`` also multiplies them by it
    before storing. A check (``write=False``) of CPU grads is torch's unscale by 1.0 (as
    torch's scaler checks them) unless ``strict``: then nothing is written. Returns None
    otherwise. No host sync."""
    if is_traced():
        inv_scale = reference.inv_scale_of(scale) if from_scale else scale
        if norm:
            return _ops.unscale_norm_(group.grads, found_inf, inv_scale, norm, backend)
        if clip_coef is not None:
            _ops.unscale_clip_(group.grads, found_inf, inv_scale, clip_coef, backend)
        elif write:
            _ops.non_finite_check_and_unscale_(group.grads, found_inf, inv_scale, backend)
        else:
            _ops.non_finite_check_(group.grads, found_inf, inv_scale, backend)
        return None
    plan = group.plan
    if plan is None and not group.reference:  # known after the first launch (kept groups)
        if resolve_backend(backend, found_inf.device) == "triton":
            plan = group.plan = _plans.plan_unscale(group.grads, group.numels, group.addresses)
        else:
            group.reference = True
    if plan is not None:
        kernels = _backend.loaded_kernels or triton_kernels()
        return kernels.launch_unscale(plan, found_inf, scale, write=write, norm=norm,
                                      clip_coef=clip_coef, inv_from_scale=from_scale)
    if norm or clip_coef is not None:
        raise ValueError("the clip's fused passes run on the Triton backend only")
    inv_scale = reference.inv_scale_of(scale) if from_scale else scale
    if not write and not strict and found_inf.device.type == "cpu":  # as torch's scaler
        reference.check_by_unscaling_by_one_(group.grads, found_inf, inv_scale)
    else:
        _reference_unscale(group.grads, found_inf, inv_scale, write)
    return None


def _reference_unscale(grads: list[torch.Tensor], found_inf: torch.Tensor,
                       inv_scale: torch.Tensor, write: bool) -> None:
    if write:
        reference.non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    else:
        reference.check_(grads, found_inf, inv_scale)


def watch_stats(grads: list[torch.Tensor], inv_scale: torch.Tensor,
                backend: str) -> torch.Tensor:
    """A watch's statistics of non-empty, same-device, same-dtype ``grads`` times
    ``inv_scale`` (0-d fp32 on their device): float64 ``[len(grads), 5]`` rows ``(amax, sum
    of squares, inf count, NaN count, 1)``. On the Triton backend a read-only launch of the
    unscale kernel storing its programs' statistics, then one launch summing them per grad
    (grads whose programs are not one run each, as grads sharing memory: torch's ops);
    else torch's ops (:func:`reference.grad_stats`). Traced code calls the registered op,
    which runs the same. No host sync."""
    if is_traced():
        return _ops.watch_stats(grads, inv_scale, backend)
    return _watch_stats_impl(grads, inv_scale, backend)


def _watch_stats_impl(grads: list[torch.Tensor], inv_scale: torch.Tensor,
                      backend: str) -> torch.Tensor:
    if resolve_backend(backend, grads[0].device) == "triton":
        kernels = _backend.loaded_kernels or triton_kernels()
        plan = _plans.plan_unscale(grads)
        runs = _plans.program_runs(plan, grads) if plan.reusable else None
        if runs is not None:
            device = grads[0].device
            stats = torch.empty((plan.grid, 4), dtype=torch.float64, device=device)
            kernels.launch_unscale(plan, torch.zeros((), device=device), inv_scale,
                                   write=False, stats=stats)
            out = torch.empty((len(grads), 5), dtype=torch.float64, device=device)
            kernels.stats.launch_finish_stats(stats, runs, out)
            return out
    return reference.grad_stats(grads, inv_scale)


def _watch_stats_fake(grads, inv_scale, backend) -> torch.Tensor:
    return grads[0].new_empty((len(grads), 5), dtype=torch.float64)


def spike_guard_step(stats: torch.Tensor, settings: torch.Tensor, norm: torch.Tensor,
                     zscore: bool, clip_mean: bool, skip: bool, backend: str) -> None:
    """One step of a :class:`~triton_scaler.SpikeGuard` on the device: ``stats`` updated in
    place from ``norm`` (one launch on Triton, torch's ops otherwise; the same bits). Traced
    code calls the registered op. No host sync."""
    if is_traced():
        _ops.spike_guard_(stats, settings, norm, zscore, clip_mean, skip, backend)
    else:
        _spike_guard_impl(stats, settings, norm, zscore, clip_mean, skip, backend)


def _spike_guard_impl(stats: torch.Tensor, settings: torch.Tensor, norm: torch.Tensor,
                      zscore: bool, clip_mean: bool, skip: bool, backend: str) -> None:
    if resolve_backend(backend, stats.device) == "triton":
        kernels = _backend.loaded_kernels or triton_kernels()
        kernels.guard.launch_spike_guard(stats, settings, norm, zscore, clip_mean, skip)
    else:
        reference.spike_guard_(stats, settings, norm, zscore, clip_mean, skip)


def note_backward(token: torch.Tensor) -> None:
    """Tell the gradient buckets that a backward follows (host only): in traced code, the
    registered op that does it where the compiled ``scale`` runs."""
    if is_traced():
        _ops.before_backward_(token)
    else:
        before_backward()


def scaler_update(scale: torch.Tensor, growth_tracker: torch.Tensor, flags: torch.Tensor,
                  policy: ScalePolicy, *, hysteresis_tracker: torch.Tensor | None,
                  skipped: torch.Tensor, skipped_count: torch.Tensor,
                  params: torch.Tensor, backend: str, skipped_bytes: torch.Tensor | None = None,
                  watch: Any = None, guard: torch.Tensor | None = None) -> None:
    """:meth:`GradScaler.update`'s one launch (:func:`run_scaler_update`), a ``watch``'s
    record (a :class:`~.telemetry.GradWatch`) included; ``skipped_bytes``: ``skipped``'s
    ``uint8`` view, when made. Traced code records for the watch in torch's ops, then calls
    the registered op, handed this iteration's overflow as a flag of its own, the flags
    zeroed after it (torch 2.8's inductor mistranslated a copy of the flags, a view of
    the scale's buffer). ``guard``: a skipping spike guard's statistics (its spike skipped
    the step: recorded, not an overflow)."""
    if not is_traced():
        run_scaler_update(
            scale, growth_tracker, flags, policy, hysteresis_tracker=hysteresis_tracker,
            skipped=skipped if skipped_bytes is None else skipped_bytes,
            skipped_count=skipped_count, backend=backend, params=params,
            watch=None if watch is None else watch.update_tensors(scale.device), guard=guard)
        return
    if watch is not None:  # the overflow and the scale it came at
        stats, overflow, counters = watch.update_tensors(scale.device)
        reference.record_watch_(flags, policy.skip_on_overflow, scale, stats, overflow, counters,
                                spiked=None if guard is None else guard[_GUARD_SPIKE] != 0)
    found = (flags != 0).any().float().reshape(1)
    _ops.scaler_update_(
        scale, growth_tracker, found, hysteresis_tracker, skipped, skipped_count, guard, params,
        policy.growth_factor, policy.backoff_factor, policy.growth_interval,
        policy.hysteresis, policy.consecutive_hysteresis, policy.min_scale, policy.max_scale,
        policy.dynamic, policy.skip_on_overflow, backend)
    flags.zero_()


def run_scaler_update(scale: torch.Tensor, growth_tracker: torch.Tensor, flags: torch.Tensor,
                      policy: ScalePolicy, *, hysteresis_tracker: torch.Tensor | None,
                      skipped: torch.Tensor, skipped_count: torch.Tensor, backend: str,
                      params: torch.Tensor | None,
                      watch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      guard: torch.Tensor | None = None) -> None:
    """The whole of :meth:`GradScaler.update` on the device. An overflow is any non-zero entry
    of ``flags`` (1-D fp32, one per optimizer); it is recorded in ``skipped`` (0-d bool, or
    its ``uint8`` view, made once by the scaler) and ``skipped_count`` (0-d int64) when
    ``policy.skip_on_overflow``, the scale is updated when ``policy.dynamic``, and ``flags``
    is zeroed; ``watch``: a watch's ``(stats, overflow, counters)`` record the iteration
    first (:func:`reference.record_watch_`; on Triton in the update's own launch when they
    are on the scale's device); ``guard``: a skipping spike guard's statistics, whose spike
    is recorded in ``skipped`` and ``skipped_count`` (not an overflow) and zeroed. One launch
    on Triton (a watch's tensors on another device: their record's ops before it); no host
    sync."""
    if resolve_backend(backend, scale.device) == "triton":  # the guard's spike read in-launch
        in_launch = watch is not None and watch[0].device == scale.device
        if watch is not None and not in_launch:
            reference.record_watch_(flags, policy.skip_on_overflow, scale, *watch,
                                    spiked=None if guard is None else guard[_GUARD_SPIKE] != 0)
        triton_kernels().launch_update_scale(
            scale, growth_tracker, flags,
            policy.kernel_params(scale.device) if params is None else params,
            hysteresis_tracker, policy.consecutive_hysteresis, dynamic=policy.dynamic,
            skipped=skipped if policy.skip_on_overflow else None,
            skipped_count=skipped_count, reset_found=True, watch=watch if in_launch else None,
            guard=guard)
        return
    spiked = None if guard is None else guard[_GUARD_SPIKE] != 0
    if watch is not None:
        reference.record_watch_(flags, policy.skip_on_overflow, scale, *watch, spiked=spiked)
    found = (flags != 0).any()
    if policy.skip_on_overflow:
        skips = found if spiked is None else found | spiked
        skipped.copy_(skips)
        skipped_count.add_(skips)
    if guard is not None:
        guard[_GUARD_SPIKE].zero_()
    if policy.dynamic:
        reference.update_scale_(scale, growth_tracker, found.float(), policy, hysteresis_tracker)
    flags.zero_()


# ---------------------------------------------------------------- the public ops' work
def unscale_or_check(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                     inv_scale: torch.Tensor, backend: Any, write: bool) -> None:
    """:func:`triton_scaler.ops.non_finite_check_and_unscale_` (``write``) or
    :func:`~triton_scaler.ops.non_finite_check_`: traced code calls the registered op, or runs
    this eagerly (a graph break) for what the op does not take (tensor subclasses, a single
    tensor, a backend that is not a string)."""
    if not is_traced():
        _unscale_or_check(grads, found_inf, inv_scale, backend, write)
    elif isinstance(grads, (list, tuple)) and isinstance(backend, str) and _plain_tensors(grads):
        op = _ops.non_finite_check_and_unscale_ if write else _ops.non_finite_check_
        op(list(grads), found_inf, inv_scale, backend)
    else:
        run_eagerly(_unscale_or_check, grads, found_inf, inv_scale, backend, write)


def _plain_tensors(tensors: Sequence) -> bool:
    """Whether each item is a plain tensor or parameter (a loop, not ``all(...)``: torch
    2.8's dynamo cannot inline a generator there)."""
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
    return True


def _unscale_or_check(grads, found_inf, inv_scale, backend, write) -> None:
    """The public ops' work, arguments checked (also the registered ops' implementation)."""
    grads = as_tensor_list(grads)
    check_flag("found_inf", found_inf, torch.float32)
    check_flag("inv_scale", inv_scale, torch.float32)
    device = found_inf.device
    if inv_scale.device != device:
        raise ValueError(f"inv_scale is on {inv_scale.device} but found_inf is on {device}")
    resolved = resolve_backend(backend, device)
    mesh_groups: list = []  # every process group any DTensor grad is sharded over
    plain = PLAIN.issuperset(map(type, grads))
    if not plain:  # rare: a DTensor (its local shard) or such
        meshes: dict = {}
        for i, g in enumerate(grads):
            if isinstance(g, torch.Tensor) and type(g) not in PLAIN:
                if g.is_nested:  # jagged (a subclass); strided ones are checked with the rest
                    raise nested_grad_error(i)
                grads[i], groups = local_grad(g, resolved, meshes)
                if groups:
                    add_groups(mesh_groups, groups)
        plain = PLAIN.issuperset(map(type, grads))
    if resolved == "reference" and write:
        check_before_writing(grads, device, plain)
        try:  # torch's op refuses sparse and nested grads before it writes any
            reference.non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            group_grads(grads, device, plain)  # raises the clearer error, if it finds one
            raise
    elif resolved == "triton":  # subclasses were unwrapped or refused above: what is not
        # plain is no tensor, which group_grads refuses; every write refused before the first
        kernels = triton_kernels()
        plans = [_plans.plan_unscale(members) for members in group_grads(grads, device, plain)]
        for plan in plans if write else ():
            _plans.refuse_overlapping_writes(plan)
        for plan in plans:
            kernels.launch_unscale(plan, found_inf, inv_scale, write=write)
    else:
        for members in group_grads(grads, device, plain):
            _reference_unscale(members, found_inf, inv_scale, write)
    if mesh_groups:  # as torch's op under DTensor dispatch, over the union of the grads'
        # sharded dimensions (torch's: its first grad's; docs/distributed.md)
        agree_over_meshes({device: found_inf}, {device: mesh_groups})


def update_scale(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                 policy: ScalePolicy, *, hysteresis_tracker: torch.Tensor | None = None,
                 backend: Any = "auto", params: torch.Tensor | None = None) -> None:
    """:func:`triton_scaler.ops.update_scale_` with its settings as a validated
    :class:`ScalePolicy`; traced code calls the registered op. No host sync."""
    if is_traced() and isinstance(backend, str):
        _ops.update_scale_(
            scale, growth_tracker, found_inf, hysteresis_tracker, policy.growth_factor,
            policy.backoff_factor, policy.growth_interval, policy.hysteresis,
            policy.consecutive_hysteresis, policy.min_scale, policy.max_scale, backend, params)
        return
    check_flag("scale", scale, torch.float32)
    check_flag("growth_tracker", growth_tracker, torch.int32)
    check_flag("found_inf", found_inf, torch.float32)
    if hysteresis_tracker is not None:
        check_flag("hysteresis_tracker", hysteresis_tracker, torch.int32)
    for name, t in (("growth_tracker", growth_tracker), ("found_inf", found_inf),
                    ("hysteresis_tracker", hysteresis_tracker)):
        if t is not None and t.device != scale.device:
            raise ValueError(f"{name} is on {t.device} but scale is on {scale.device}; scale, "
                             "growth_tracker, found_inf and hysteresis_tracker must share one "
                             "device")
    if resolve_backend(backend, scale.device) == "triton":
        if params is None:
            params = policy.kernel_params(scale.device)
        triton_kernels().launch_update_scale(scale, growth_tracker, found_inf, params,
                                             hysteresis_tracker, policy.consecutive_hysteresis)
    else:
        reference.update_scale_(scale, growth_tracker, found_inf, policy, hysteresis_tracker)


def update_scale_with_settings(scale: torch.Tensor, growth_tracker: torch.Tensor,
                               found_inf: torch.Tensor, hysteresis_tracker: torch.Tensor | None,
                               growth_factor: float, backoff_factor: float,
                               growth_interval: int, hysteresis: int,
                               consecutive_hysteresis: bool, min_scale: float,
                               max_scale: float, backend: str,
                               params: torch.Tensor | None) -> None:
    """:func:`triton_scaler.ops.update_scale_` (also the registered op's implementation):
    traced code hands settings that are Python numbers of their kinds to the registered op
    (which validates them at run time); anything else is validated here, and refused with
    its name."""
    if is_traced() and isinstance(backend, str) and _numbers(
            (growth_factor, backoff_factor, min_scale, max_scale), (growth_interval, hysteresis),
            (consecutive_hysteresis,)):
        _ops.update_scale_(scale, growth_tracker, found_inf, hysteresis_tracker,
                           float(growth_factor), float(backoff_factor), growth_interval,
                           hysteresis, consecutive_hysteresis, float(min_scale),
                           float(max_scale), backend, params)
        return
    policy = cached_policy(growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                           max_scale=max_scale)
    update_scale(scale, growth_tracker, found_inf, policy, hysteresis_tracker=hysteresis_tracker,
                 backend=backend, params=params)


def _numbers(reals: tuple, ints: tuple, bools: tuple) -> bool:
    """Whether the settings are Python numbers of their kinds, which the registered ops take."""
    for v in reals:
        if type(v) is not int and type(v) is not float:
            return False
    for v in ints:
        if type(v) is not int:
            return False
    for v in bools:
        if type(v) is not bool:
            return False
    return True


# ---------------------------------------------------------------- the registered ops
_NAMESPACE = "triton_scaler"


def _unscale_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                  backend: str) -> None:
    _unscale_or_check(grads, found_inf, inv_scale, backend, write=True)


def _check_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                backend: str) -> None:
    _unscale_or_check(grads, found_inf, inv_scale, backend, write=False)


def _norm_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
               norm: int, backend: str) -> torch.Tensor:
    partial = triton_kernels().launch_unscale(_plans.plan_unscale(grads), found_inf, inv_scale,
                                              write=False, norm=norm)
    assert partial is not None  # a norm pass returns its partial
    return partial


def _norm_fake(grads, found_inf, inv_scale, norm, backend) -> torch.Tensor:
    fp64 = bool(grads) and grads[0].dtype == torch.float64
    return found_inf.new_empty((), dtype=torch.float64 if fp64 else torch.float32)


def _clip_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
               clip_coef: torch.Tensor, backend: str) -> None:
    triton_kernels().launch_unscale(_plans.plan_unscale(grads), found_inf, inv_scale,
                                    write=True, clip_coef=clip_coef)


def _scaler_update_impl(scale: torch.Tensor, growth_tracker: torch.Tensor, flags: torch.Tensor,
                        hysteresis_tracker: torch.Tensor | None, skipped: torch.Tensor,
                        skipped_count: torch.Tensor, guard: torch.Tensor | None,
                        params: torch.Tensor,
                        growth_factor: float, backoff_factor: float, growth_interval: int,
                        hysteresis: int, consecutive_hysteresis: bool, min_scale: float,
                        max_scale: float, dynamic: bool, skip_on_overflow: bool,
                        backend: str) -> None:
    policy = cached_policy(growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                           max_scale=max_scale, dynamic=dynamic,
                           skip_on_overflow=skip_on_overflow)
    run_scaler_update(scale, growth_tracker, flags, policy,
                      hysteresis_tracker=hysteresis_tracker, skipped=skipped.view(torch.uint8),
                      skipped_count=skipped_count, backend=backend, params=params, guard=guard)


def _before_backward_impl(token: torch.Tensor) -> None:
    before_backward()


def _nothing(*args, **kwargs) -> None:
    """The fake implementation of the ops that return nothing: each mutates its arguments
    in place, which keeps their shapes, dtypes and devices."""
    return None


def _define(name: str, mutates: tuple[str, ...], impl, fake=_nothing) -> None:
    if hasattr(getattr(torch.ops, _NAMESPACE), name):  # registered once per process
        return
    op = custom_op(f"{_NAMESPACE}::{name}", mutates_args=mutates)(impl)
    op.register_fake(fake)


_define("non_finite_check_and_unscale_", ("grads", "found_inf"), _unscale_impl)
_define("non_finite_check_", ("found_inf",), _check_impl)
_define("unscale_norm_", ("found_inf",), _norm_impl, _norm_fake)
_define("unscale_clip_", ("grads", "found_inf"), _clip_impl)
_define("update_scale_", ("scale", "growth_tracker", "hysteresis_tracker"),
        update_scale_with_settings)
_define("scaler_update_", ("scale", "growth_tracker", "flags", "hysteresis_tracker", "skipped",
                           "skipped_count", "guard"), _scaler_update_impl)
_define("before_backward_", ("token",), _before_backward_impl)
_define("watch_stats", (), _watch_stats_impl, _watch_stats_fake)
_define("spike_guard_", ("stats",), _spike_guard_impl)

#: ``torch.ops.triton_scaler``: the registered ops, e.g. ``_ops.scaler_update_``.
_ops = getattr(torch.ops, _NAMESPACE)
ops_namespace = _ops
