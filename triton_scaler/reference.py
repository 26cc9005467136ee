"""Pure-PyTorch reference path: device-agnostic, bit-exact with torch's ops, no host sync.

These functions are the oracle the Triton kernels are tested against, and the CPU fallback.
They call torch's own fused ops wherever the result is identical, so the CPU path is as fast
as ``torch.amp.GradScaler("cpu")``.
"""

from __future__ import annotations

import math
import operator

import torch
from torch._utils import _flatten_dense_tensors

from ._memory import covers
from .policy import ScalePolicy

# A read of a CPU tensor is not a host-device synchronisation. Bound once, so the host-sync
# counters of the tests (which patch ``torch.Tensor.item``) count only real device reads.
_read_cpu_scalar = torch.Tensor.item


def inv_scale_of(scale: torch.Tensor) -> torch.Tensor:
    """torch's reciprocal of a 0-d fp32 scale: ``fp32(1 / fp64(scale))`` (three ops)."""
    return scale.double().reciprocal().float()


def _may_overflow(inv_scale: torch.Tensor) -> bool:
    """Whether ``finite * inv_scale`` can be non-finite, i.e. ``inv_scale`` is not in [0, 1].

    On CPU the value is read directly (there is no device to synchronise with); elsewhere the
    answer is conservatively True, which costs one extra read of the grads.
    """
    return not inv_scale.is_cpu or not 0.0 <= _read_cpu_scalar(inv_scale) <= 1.0


def _unaliased(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Drop grads that start at the address of an earlier non-empty one (``p2.grad =
    p1.grad.t()``): each memory location is unscaled once (torch's op unscales it twice)."""
    if len(set(map(torch.Tensor.data_ptr, grads))) == len(grads):  # C-level: the usual case
        return grads
    addresses = [g.data_ptr() if g.numel() else None for g in grads]
    largest: dict[int, torch.Tensor] = {}  # per address, the alias with the most elements
    for g, address in zip(grads, addresses):
        if address is not None and (address not in largest
                                    or g.numel() > largest[address].numel()):
            largest[address] = g
    for g, address in zip(grads, addresses):
        kept = largest.get(address) if address is not None else None  # None: an empty grad
        if kept is not None and kept is not g and not covers(kept, g):
            raise RuntimeError(
                "unsupported operation: two gradients start at the same address but the one "
                "with more elements does not cover the other's memory (a view with gaps "
                f"beside another: shapes {tuple(g.shape)} and {tuple(kept.shape)}"
                "); grads that start at one address are unscaled once: clone() one of them")
    return [g for g in grads if g.numel() == 0] + list(largest.values())


def non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``grads[i] = dtype(fp32(grads[i]) * inv_scale)`` (float64 grads: in float64);
    ``found_inf = 1.0`` if an input or a product is non-finite. Grads share found_inf's device;
    any mix of float dtypes."""
    grads = _unaliased(grads)
    for_torchs_op = grads
    may_overflow = _may_overflow(inv_scale)
    if lacks_bf16_unscale(found_inf.device):
        bf16 = [g for g in grads if g.dtype == torch.bfloat16]
        if bf16:  # torch's op has no kernel for them here: its arithmetic in tensor ops
            multiply_as_torchs_op_(bf16, inv_scale)
            if not may_overflow:  # else the check of every product below covers them
                check_(bf16, found_inf)  # a non-finite input gives a non-finite product
            for_torchs_op = [g for g in grads if g.dtype != torch.bfloat16]
    if for_torchs_op:
        torch._amp_foreach_non_finite_check_and_unscale_(for_torchs_op, found_inf, inv_scale)
    if may_overflow:
        # torch checks only the inputs; a scale below 1 (or 0) can overflow the products,
        # which are now stored in the grads.
        check_(grads, found_inf)


def lacks_bf16_unscale(device: torch.device) -> bool:
    """Whether torch's ``_amp_foreach_non_finite_check_and_unscale_`` has no bfloat16 kernel on
    ``device`` (CUDA: it raises ``NotImplementedError``; the CPU op has one)."""
    return device.type == "cuda"


def multiply_as_torchs_op_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    """``grads[i] = dtype(fp32(grads[i]) * inv_scale)`` in tensor ops, torch's op's arithmetic
    (a float32 product rounded to the grad's dtype) without its check. Half-precision grads."""
    for g in grads:
        if g.numel():
            g.copy_(g.float().mul_(inv_scale))


def _max_abs_per_dtype(grads: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Per dtype, the largest ``|x|`` over the grads (NaN when one holds a NaN), as a 0-d
    tensor of that dtype; dtypes whose grads are all empty left out. Reads the grads, never
    writes them."""
    dtypes = set(map(_DTYPE, grads))
    groups = {dtypes.pop(): grads} if len(dtypes) == 1 else \
        {dtype: [g for g in grads if g.dtype == dtype] for dtype in dtypes}
    peaks = {}
    for dtype, tensors in groups.items():
        peak = _max_abs(tensors)
        if peak is not None:
            peaks[dtype] = peak
    return peaks


_DTYPE = operator.attrgetter("dtype")
_NUMEL = torch.Tensor.numel
#: On the CPU, grads of at most this many elements in all are read as one flat copy (one
#: ``aminmax`` over it costs less than one call per small tensor); beyond, the small ones.
_FLAT_ELEMENTS = 1 << 20
_SMALL_ELEMENTS = 1 << 14


def _cpu_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Same-dtype non-empty CPU ``tensors`` as few tensors to reduce: the small ones
    flattened together, each larger one as it is (a reduction per small tensor costs more
    than the copy)."""
    if len(tensors) == 1:
        return tensors
    numels = list(map(_NUMEL, tensors))
    if sum(numels) <= _FLAT_ELEMENTS:
        return [_flatten_dense_tensors(tensors)]
    small = [t for t, n in zip(tensors, numels) if n <= _SMALL_ELEMENTS]
    parts = [t for t, n in zip(tensors, numels) if n > _SMALL_ELEMENTS]
    return parts + ([_flatten_dense_tensors(small)] if len(small) > 1 else small)


def _cpu_sums_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every element of the CPU ``grads`` is finite, known from their sums (an inf or
    a NaN makes a sum inf or NaN): True when each sum is finite; False when one is not (an
    inf or NaN, or finite values whose sum overflowed: the caller then looks closer). A sum
    reads faster than ``aminmax`` on the CPU. No device sync (CPU values)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        for part in _cpu_parts(tensors):
            if not math.isfinite(_read_cpu_scalar(part.sum())):
                return False
    return True


def _max_abs(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The largest ``|x|`` over same-dtype ``tensors`` (NaN when one holds a NaN), None when
    they hold no element. On CPU ``max(max, -min)`` of ``aminmax`` over :func:`_cpu_parts`
    (torch's CPU inf-norm reduction is several times slower). On other devices one foreach
    inf-norm: one fused launch."""
    numels = list(map(_NUMEL, tensors))
    if not sum(numels):
        return None
    if 0 in numels:
        tensors = [t for t, n in zip(tensors, numels) if n]
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, math.inf)).max()
    parts = _cpu_parts(tensors)
    if len(parts) == 1:
        low, high = torch.aminmax(parts[0])
        return torch.maximum(high, low.neg())
    lows, highs = zip(*map(torch.aminmax, parts))
    return torch.maximum(torch.stack(highs).max(), torch.stack(lows).min().neg())


def check_(grads: list[torch.Tensor], found_inf: torch.Tensor,
           inv_scale: torch.Tensor | None = None) -> None:
    """Set ``found_inf = 1.0`` if an element of ``grads`` is non-finite or, with ``inv_scale``,
    if its product with ``inv_scale`` is (in float32; float64 grads in float64), exactly as
    the Triton check. Read-only: the grads are neither written nor required to be writable.
    On the CPU their sums first: when each is finite (and no product can overflow) nothing
    more is read."""
    if grads and found_inf.is_cpu and (inv_scale is None or not _may_overflow(inv_scale)) \
            and grads[0].is_cpu and _cpu_sums_finite(grads):
        return
    non_finite = []
    for dtype, peak in _max_abs_per_dtype(grads).items():
        non_finite.append(~peak.isfinite())
        if inv_scale is not None and _may_overflow(inv_scale):
            # Rounding is monotonic: some |x| * inv overflows iff max |x| * inv does.
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            non_finite.append(~(peak.to(wide) * inv_scale.to(wide)).isfinite())
    if non_finite:
        flag = non_finite[0] if len(non_finite) == 1 else torch.stack(non_finite).any()
        found_inf.copy_(torch.where(flag, 1.0, found_inf))


def check_by_unscaling_by_one_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                               inv_scale: torch.Tensor) -> None:
    """:func:`check_` of CPU grads as torch's scaler checks them for a fused optimizer
    (``_check_inf_per_device``): torch's unscale op by 1.0, which writes every grad back as
    it was (no value changes; the version counters move, as under torch's scaler), one C++
    call where a read-only pass costs a Python call per grad. The products with
    ``inv_scale`` are checked too where they may overflow (a scale below 1), as the Triton
    check does."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, _ONE)
    if _may_overflow(inv_scale):
        check_(grads, found_inf, inv_scale)


_ONE = torch.ones((), dtype=torch.float32)  # torch's inv_scale for a check, on the CPU


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    policy: ScalePolicy,
    hysteresis_tracker: torch.Tensor | None,
) -> None:
    """torch's ``_amp_update_scale_`` plus hysteresis and a floor / cap, with tensor ops only."""
    growth_factor, backoff_factor = policy.growth_factor, policy.backoff_factor
    growth_interval, hysteresis = policy.growth_interval, policy.hysteresis
    min_scale, max_scale = policy.min_scale, policy.max_scale
    if hysteresis_tracker is None and min_scale == 0.0 and max_scale == math.inf:
        torch._amp_update_scale_(scale, growth_tracker, found_inf,
                                 growth_factor, backoff_factor, growth_interval)
        return
    scale64 = scale.double()
    found = found_inf != 0
    successful = growth_tracker + 1
    at_interval = successful == growth_interval
    backed = scale64 * backoff_factor
    if min_scale > 0:  # 0: no floor (torch's rule), as the kernel
        backed = torch.where(backed < min_scale, min_scale, backed)
    backed = backed.float()
    grown = scale64 * growth_factor
    grown = torch.where(grown > max_scale, max_scale, grown).float()
    back_off = found
    if hysteresis_tracker is not None:
        decremented = hysteresis_tracker - 1
        back_off = found & (decremented <= 0)
        refill = (torch.ones_like(at_interval) if policy.consecutive_hysteresis
                  else at_interval)
        refilled = torch.where(refill, hysteresis, hysteresis_tracker)
        hysteresis_tracker.copy_(torch.where(found, decremented, refilled))
    new_scale = torch.where(found, torch.where(back_off, backed, scale),
                            torch.where(at_interval & grown.isfinite(), grown, scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(torch.where(found | at_interval, 0, successful))


_CHUNK_ELEMENTS = 2**26  # the statistics' temporaries: at most twice this many elements


def _stat_chunks(grads: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(start, stop)`` runs of ``grads`` of at most ``_CHUNK_ELEMENTS`` elements (or one
    grad), so that the temporaries of :func:`grad_stats` stay bounded."""
    runs, start, total = [], 0, 0
    for i, grad in enumerate(grads):
        if total and total + grad.numel() > _CHUNK_ELEMENTS:
            runs.append((start, i))
            start, total = i, 0
        total += grad.numel()
    runs.append((start, len(grads)))
    return runs


def grad_stats(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """``[amax, norm**2, inf count, NaN count, 1]`` per grad (float64 rows) of ``grad *
    inv_scale`` for non-empty, same-dtype ``grads`` on one device: :func:`_chunk_stats` in
    runs of at most 2**26 elements (a fixed number of ops per run, temporaries bounded)."""
    dtype = grads[0].dtype
    return torch.cat([_chunk_stats(grads[start:stop], inv_scale, dtype)
                      for start, stop in _stat_chunks(grads)])


def _chunk_stats(grads: list[torch.Tensor], inv_scale: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """``[amax, norm**2, inf count, NaN count, 1]`` per grad (float64 rows) of ``grad *
    inv_scale``, for non-empty ``grads`` of ``dtype``: amax and the counts as torch computes
    them from the unscaled grad, the norm accumulated in float32 (float64 for float64 grads).
    Nine ``torch._foreach`` ops, whatever the number of grads."""
    unscaled = torch._foreach_mul(grads, inv_scale.to(grads[0].device))
    norm = torch._foreach_norm(unscaled, 2, dtype=torch.float64 if dtype == torch.float64
                               else torch.float32)
    torch._foreach_abs_(unscaled)
    amax = torch._foreach_norm(unscaled, math.inf)
    finite = torch._foreach_clamp_max(unscaled, torch.finfo(dtype).max)  # NaN stays NaN
    torch._foreach_sub_(unscaled, finite)  # 0 where finite, inf where inf, NaN where NaN
    nonfinite = torch._foreach_norm(unscaled, 0)  # ord 0: how many are not 0
    torch._foreach_sub_(finite, finite)  # NaN where NaN, else 0
    nan = torch._foreach_norm(finite, 0)
    nonfinite_t, nan_t = torch.stack(nonfinite).double(), torch.stack(nan).double()
    return torch.stack([torch.stack(amax).double(), torch.stack(norm).double().square(),
                        nonfinite_t - nan_t, nan_t, torch.ones_like(nan_t)], dim=1)


def record_watch_(flags: torch.Tensor, skips: bool, scale: torch.Tensor, stats: torch.Tensor,
                  overflow: torch.Tensor, counters: torch.Tensor,
                  spiked: torch.Tensor | None = None) -> None:
    """A watch's record of one ``update()`` (the update kernel's ``WATCH``, in torch's ops):
    an overflow (a non-zero flag, or a watched row with inf or NaN counts) copies the rows'
    counts to ``overflow`` and sets ``counters`` ``[last overflow's iteration, its scale,
    iteration, run of skipped steps, longest run]`` (float64: exact); ``spiked``: a spike
    guard skipped the step (the run grows)."""
    found = (flags != 0).any()
    hit = found.to(counters.device).reshape(()) | (stats[:, 2:4].sum() > 0)
    overflow.copy_(torch.where(hit, stats[:, 2:4], overflow))
    skip = hit if spiked is None else hit | spiked.to(counters.device).reshape(())
    skipped = skip.double() if skips else torch.zeros_like(counters[3])
    run = (counters[3] + 1) * skipped
    counters.copy_(torch.stack([
        torch.where(hit, counters[2], counters[0]),
        torch.where(hit, scale.to(counters.device, torch.float64).reshape(()), counters[1]),
        counters[2] + 1, run, torch.maximum(counters[4], run)]))


def spike_guard_(stats: torch.Tensor, settings: torch.Tensor, norm: torch.Tensor,
                 zscore: bool, clip_mean: bool, skip: bool) -> None:
    """One step of the spike guard (``kernels/guard.py``'s kernel, op for op, in torch's ops):
    ``stats`` (float64, its ``STATS_LAYOUT``) updated in place from the total ``norm`` before
    clipping and ``settings`` (float64, its ``SETTINGS_LAYOUT``). No host sync."""
    alpha, beta, z_thresh, eps, clip_factor, max_norm, warmup = settings.unbind()
    count, mean, var, _, _, spikes, last_norm, last_threshold, last_step, steps = stats.unbind()
    x = norm.to(torch.float64).reshape(())
    finite = x.isfinite()
    after_warmup = count >= warmup
    n = count + 1.0
    before = torch.where(count > 0.0, mean / count.clamp_min(1.0), 0.0)
    total = mean + x
    after = total / n
    deviations = var + (x - before) * (x - after)
    done = n == warmup
    warm_mean = torch.where(done, after, total)
    warm_var = torch.where(done, deviations / n, deviations)
    std = var.sqrt()
    if zscore:
        z = (x - mean) / (std + eps)
        spike = z > z_thresh
        threshold = mean if clip_mean else \
            (mean + (z_thresh * std) / (z / z_thresh)) * clip_factor
    else:
        threshold = mean + z_thresh * std
        spike = x > threshold
    spike = spike & finite & after_warmup
    value = torch.where(spike, threshold, x)
    ema_mean = alpha * mean + beta * value
    deviation = value - ema_mean
    ema_var = alpha * var + beta * (deviation * deviation)
    if skip:
        feeds = finite & after_warmup & ~spike
        limit = max_norm
    else:
        feeds = finite & after_warmup
        limit = torch.where(spike, torch.minimum(threshold, max_norm), max_norm)
    warming = ~after_warmup & finite
    steps = steps + 1.0
    stats.copy_(torch.stack([
        torch.where(warming, n, count),
        torch.where(warming, warm_mean, torch.where(feeds, ema_mean, mean)),
        torch.where(warming, warm_var, torch.where(feeds, ema_var, var)),
        limit, spike.double(), spikes + spike.double(),
        torch.where(spike, x, last_norm), torch.where(spike, threshold, last_threshold),
        torch.where(spike, steps, last_step), steps]))
