"""One flat gradient buffer (:class:`GradBucket`): the views, the checks that they are
still the grads, and the way back when they are not (DDP's reduced grads of locally unused
parameters found, views of grads that are None zeroed, grads copied back into their views
or left outside, views re-pointed: the per-parameter path only, never the O(1) step).
:class:`triton_scaler.GradBuckets` builds them."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._compile import never_traced
from ._warn import warn_at_caller

_ALIGN_BYTES = 16
#: The attribute of an optimizer listing the GradBuckets built over it.
_REGISTRY_ATTR = "_triton_scaler_buckets"
# Parameters held by live buckets. Kept off the parameters themselves, so a pickled or copied
# model (torch.save, deepcopy) carries no trace of buckets it no longer has.
_bucketed: WeakIdKeyDictionary = WeakIdKeyDictionary()
_live_buckets: weakref.WeakSet[GradBucket] = weakref.WeakSet()  # for before_backward()


def _grad_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides torch gives ``p``'s gradient: ``p``'s own when it is dense and
    non-overlapping (channels_last, a transpose), else row-major. Fused optimizers read param
    and grad as flat memory, so a grad must have exactly these."""
    return torch.empty_like(p, device="meta").stride()


def _distributed() -> bool:
    """A default process group exists (DDP may write grads without autograd)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors (TensorImpls) share ``t``'s storage, plus one for its Python object,
    held through the query. A storage has one Python object, counted once, so one held
    elsewhere (Triton's interpreter leaves one in a reference cycle per launch) changes
    nothing. (torch 2.8 counts that object only while it lives: read through a temporary, the
    count would be one lower, and one higher while such a cycle lives, hiding a lost view.)"""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata)


def before_backward() -> None:  # host bookkeeping: traced code calls the registered op
    """A backward is about to start (:meth:`GradScaler.scale` calls this): each live bucket
    forgets the writes since its last check that no accumulation balanced (grads zeroed in
    place by ``zero_grad(set_to_none=False)``), so they cannot hide an accumulation of this
    backward that made a new grad instead of writing into a view. A shortfall is kept. Host
    only, O(number of buckets)."""
    # its set of weak references (private): one C call, as other threads may add buckets
    for ref in tuple(_live_buckets.data):  # type: ignore[attr-defined]
        bucket = ref()
        if bucket is not None:
            bucket.forget_surplus_writes()


class GradBucket:
    """One contiguous gradient buffer for parameters of one device and dtype.

    Each parameter's grad is a view into :attr:`buffer` (16-byte aligned, with the strides
    torch gives that parameter's grad); the buffer's size is padded to a multiple of 16
    elements, so the one launch over it runs aligned, mask-free vector accesses.

    Per step the bucket costs O(1) host work while every grad is still its view and every
    parameter received a gradient: the views are counted through the storage's reference
    count (a grad replaced by ``zero_grad(set_to_none=True)``, by assignment or set to None
    frees its view) and the gradients through post-accumulate-grad hooks that are C calls.
    Anything else takes the per-parameter path, which puts grads back in place.
    """

    def __init__(self, params: list[torch.Tensor], on_detach: str) -> None:
        self.params = params
        self.device = params[0].device
        self.dtype = params[0].dtype
        align = _ALIGN_BYTES // params[0].element_size()
        self._layout, total = [], 0
        for p in params:
            self._layout.append((p.shape, _grad_strides(p), total))
            total += -(-p.numel() // align) * align  # each view starts 16-byte aligned
        total = -(-total // 16) * 16  # a size % 16 == 0: the launch specialises aligned
        # -0.0, not 0.0: autograd accumulates into a view (grad += g), and -0.0 + g is g
        # bit for bit, a -0.0 in g included (0.0 + -0.0 is 0.0), as a fresh grad would be
        self.buffer = torch.full((total,), -0.0, dtype=self.dtype, device=self.device)
        covered = torch.zeros(total, dtype=torch.bool, device="cpu")
        for p, (_, _, offset) in zip(params, self._layout):
            covered[offset:offset + p.numel()] = True
        # the alignment padding: zero, and zeroed again by the scaler's update() after a
        # write that may not keep it (0 * an infinite inv_scale or a NaN clip coefficient),
        # or found_inf would stay set
        self.padding = (~covered).nonzero().flatten().to(self.device) if not covered.all() \
            else None
        self.param_ids = frozenset(id(p) for p in params)
        self._on_detach = on_detach
        self._warned = False
        # Parameters (by index) whose grad autograd wrote since the last zero_(): the others
        # get ``grad = None`` before the step, as after torch's default zero_grad(), so
        # optimizers skip them (no weight decay, momentum or state for unused or frozen ones).
        self.received: dict[int, torch.Tensor] = {}
        self._unset_by_us: set[int] = set()
        # Parameters whose grad was not their view at the last check (None, or outside): the
        # O(1) check cannot vouch for them (a view held elsewhere keeps the storage's count,
        # and zeroing the others in place bumps the version as accumulations would)
        self.not_views: set[int] = set()
        self._zeroed: set[int] = set()  # views zeroed while their grad is None
        #: attach_grads() ran since the last backward began or zero_(): a fused step right
        #: after the check that attached them need not attach again
        self.attached = False
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(self.received.__setitem__, i)) for i, p in enumerate(params)]
        # Accumulations are counted, to compare with the buffer's version: one into a view
        # bumps it, one that makes a new grad (the grad was None) does not. Each takes one
        # item of a long repeat (a C call, no memory held); the count is what it has left.
        self._countdown = itertools.repeat(None, 2**62)
        self._hooks += [p.register_post_accumulate_grad_hook(
            functools.partial(next, self._countdown)) for p in params]
        self._all_views_refs = _storage_refs(self.buffer) + len(params)
        # the first and last non-empty parameters (an empty tensor's data_ptr() is 0)
        filled = [i for i, p in enumerate(params) if p.numel()]
        self._spot_checks = [(params[i], self.view(i).data_ptr())
                             for i in sorted(set(filled[:1] + filled[-1:]))]
        with torch.no_grad():
            for i, p in enumerate(params):
                view = self.view(i)
                if p.grad is not None:
                    view.copy_(p.grad)
                    self.received[i] = p
                p.grad = view
        self.checked()
        _live_buckets.add(self)

    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient view into the buffer (a new tensor object each call)."""
        shape, strides, offset = self._layout[i]
        return self.buffer.as_strided(shape, strides, offset)

    def _in_buffer(self, grad: torch.Tensor) -> bool:
        """``grad`` is a dense tensor over this bucket's buffer (any piece of it)."""
        return grad.layout == torch.strided and \
            grad.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def _is_view(self, i: int, grad: torch.Tensor) -> bool:
        shape, strides, offset = self._layout[i]
        # bool(): in torch 2.14's annotations the offset's comparison is a SymBool (host ints)
        return bool(self._in_buffer(grad) and grad.storage_offset() == offset
                    and grad.shape == shape and grad.stride() == strides
                    and grad.dtype == self.dtype)

    def checked(self) -> None:
        """Start counting accumulations and buffer writes afresh (after a check or a fill)."""
        self._left = operator.length_hint(self._countdown)
        self._version = self.buffer._version
        self._forgotten_writes = 0

    def _writes_and_accumulations(self) -> tuple[int, int]:
        """O(1): the buffer's writes and autograd's accumulations since :meth:`checked`."""
        return (self.buffer._version - self._version,
                self._left - operator.length_hint(self._countdown))

    def forget_surplus_writes(self) -> None:
        """O(1): count from here as if the buffer had been written as often as autograd
        accumulated since :meth:`checked`, when it was written more often."""
        self.attached = False
        writes, accumulations = self._writes_and_accumulations()
        if writes > accumulations:
            self._version += writes - accumulations
            self._forgotten_writes += writes - accumulations  # (still writes for DDP's)

    def all_views_in_place(self) -> bool:
        """O(1): every parameter's grad is still a live view of the buffer, by the storage's
        reference count (another tensor over the buffer kept alive, ``p.grad.view(-1)``,
        makes this False; a list of the grads themselves does not) and the addresses of the
        first and last non-empty parameters' grads: views held elsewhere keep the count when
        grads were replaced too (``zero_grad()`` while a list holds last step's grads)."""
        if _storage_refs(self.buffer) != self._all_views_refs:
            return False
        for param, address in self._spot_checks:  # (no other tensor can be at its address)
            grad = param.grad
            if grad is None or grad.data_ptr() != address:
                return False
        return True

    def attach_grads(self) -> frozenset[int]:
        """Check that every grad is still its view and deal with those that are not; give the
        parameters that received no gradient since :meth:`GradBuckets.zero_` ``grad = None``.

        Their views are zeroed (whatever was written into them is no grad: the bucket's
        launches read the whole buffer). Returns the ids of the parameters whose grads this
        bucket's buffer now holds (the object :attr:`param_ids` itself when it holds all; none
        of a parameter whose grad is None, so an optimizer none of whose parameters has a
        grad raises in ``step`` as in torch). A grad replaced by ``zero_grad(set_to_none=
        True)`` is copied back into its view (``on_detach="reattach"``) or left to the
        per-tensor path (``"warn"``); both warn once.
        """
        received = self.received
        writes, accumulations = self._writes_and_accumulations()
        fast = not self.not_views and len(received) == len(self.params) and \
            writes >= accumulations and self.all_views_in_place()
        writes += self._forgotten_writes
        self.checked()
        if fast:
            self.attached = True
            return self.param_ids  # the O(1) path: nothing to do
        detached: list[int] = []
        quiet: list[int] = []
        unset: list[int] = []
        held: list[int] = []
        dropped: list[int] = []
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is not None and self._is_view(i, grad):
                (held if i in received else dropped).append(i)
            elif grad is None:  # set to None outside: the view must not keep stale values
                unset.append(i)
            elif i in self._unset_by_us:  # we set it to None; autograd made a new one
                quiet.append(i)
            elif grad._is_view() and grad._base is not self.buffer:  # DDP's bucket views
                raise RuntimeError(
                    "a gradient is a view into another buffer, not into its GradBucket: DDP "
                    "with gradient_as_bucket_view=True keeps grads in its own contiguous "
                    "buckets and replaces ours. Do not combine the two: drop GradBuckets (the "
                    "scaler covers DDP's grads with one chunk-table launch per (device, dtype)) "
                    "or build DDP with gradient_as_bucket_view=False")
            else:  # not a view any more: zero_grad(set_to_none=True), assigned, or its
                # memory replaced (``grad.data = t``, ``grad.set_(t)``: still a view object)
                detached.append(i)
        if dropped and writes > accumulations and _distributed():  # written, no accumulation:
            held += self._written_views_of(dropped)  # DDP's reduced grad of a locally unused
            dropped = [i for i in dropped if i not in received]  # parameter, as torch steps
        for i in dropped:  # no gradient this iteration: as torch, grad None
            self.params[i].grad = None
            self._unset_by_us.add(i)
        if unset or dropped:  # (a dropped view was a grad until now: it may have been written)
            self._zeroed.difference_update(dropped)
            self._zero_views_of(unset + dropped)
        for i in quiet + detached:  # a new grad (autograd's, DDP's reduced one, assigned) is a
            received[i] = self.params[i]  # gradient of this iteration, hooks or not
        outside: set[int] = set()
        if quiet:  # grads we set to None and autograd re-created: back in, no warning
            self._unset_by_us.difference_update(quiet)
            outside |= self._reattach(quiet)
        if detached:
            if not self._warned:
                self._warned = True
                warn_at_caller(
                    f"{len(detached)} gradient(s) are no longer views into their GradBucket "
                    "(was optimizer.zero_grad() called with set_to_none=True, or a grad "
                    "assigned or its .data replaced?). "
                    + ("They are copied back into the bucket each step, which costs a copy; "
                       if self._on_detach == "reattach" else
                       "They take the per-tensor path, off the one-launch fast path; ")
                    + "call buckets.zero_() or optimizer.zero_grad(set_to_none=False) instead.")
            outside |= self._reattach(detached, self._on_detach == "reattach")
        ids = frozenset(id(self.params[i]) for i in held + quiet + detached) - outside
        self.not_views = set(unset + dropped) | {self._index[pid] for pid in outside}
        self.attached = True
        return self.param_ids if len(ids) == len(self.params) else ids

    def zero_(self) -> None:
        """One fill of the buffer (with -0.0), every grad its view again, and this step's records
        cleared. The re-pointing loop runs only when needed: when the O(1) check fails, or
        when grads were not views at the last check (a view held elsewhere may keep the
        storage's count)."""
        if self.not_views or not self.all_views_in_place():
            self._repoint()
        self.not_views.clear()
        self.received.clear()
        self._unset_by_us.clear()
        self._zeroed.clear()
        self.attached = False
        self.buffer.fill_(-0.0)  # (-0.0 + g == g exactly, see __init__)
        self.checked()

    def buffer_rewritten(self) -> None:
        """A write pass over the whole buffer that may not keep zeros zero ran (0 * a NaN
        clip coefficient): the views of parameters whose grad is None are zeroed again at
        the next :meth:`attach_grads`."""
        self._zeroed.clear()

    # ------------------------------------------------ the per-parameter path's repairs
    def _written_views_of(self, indices: list[int]) -> list[int]:
        """The parameters among ``indices`` (none received a gradient from autograd) whose
        views hold a value other than zero: DDP with ``find_unused_parameters=True`` writes
        the reduced gradient of a parameter unused on this rank but used on another into its
        grad, which torch's optimizer then steps. Recorded as received. One host read; runs
        only with a process group and when the buffer was written more often than autograd
        accumulated. (Without a process group a value written into such a view is no grad:
        torch's grad is None there, so code writing into every ``p.grad`` skips it.)"""
        if self.buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            return []  # no host read inside a CUDA graph capture
        with torch.no_grad():
            flags = torch.stack([(self.view(i) != 0).any() for i in indices]).tolist()
        written = [i for i, flag in zip(indices, flags) if flag]
        for i in written:
            self.received[i] = self.params[i]
        return written

    def _zero_views_of(self, indices: list[int]) -> None:
        """Zero the views of parameters whose grad is None, once until they are written (one
        ``_foreach_zero_``): the bucket's launches read them, and they are no grads."""
        todo = [i for i in indices if i not in self._zeroed]
        if todo:
            self._zeroed.update(todo)
            with torch.no_grad():
                torch._foreach_zero_([self.view(i) for i in todo])

    def _reattach(self, detached: list[int], copy_back: bool = True) -> set[int]:
        """Copy each grad back into its view (or zero the view and leave the grad outside);
        returns the ids of the parameters left outside the bucket."""
        outside = set()
        with torch.no_grad():
            # a grad that is itself a piece of this buffer (two parameters of one shape
            # whose grads were swapped) is read before any view is written: copied out first
            grads = [self._own_piece_copied(self.params[i].grad) for i in detached]
            for i, grad in zip(detached, grads):
                p, view = self.params[i], self.view(i)
                if grad is not None and copy_back and not grad.is_sparse:
                    view.copy_(grad)
                    p.grad = view
                    self._zeroed.discard(i)
                else:
                    if grad is not p.grad:  # a piece of the buffer: its own memory, outside
                        p.grad = grad
                    view.zero_()  # the bucket launch must not see stale values
                    outside.add(id(p))
        return outside

    def _own_piece_copied(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad``, or a copy of it when it lies in this bucket's buffer."""
        return grad.clone() if grad is not None and self._in_buffer(grad) else grad

    def _repoint(self) -> None:
        """Give every parameter whose grad is not its view the view again."""
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None or not self._is_view(i, grad):
                p.grad = self.view(i)

    def _release(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                grad = p.grad
                if grad is not None and self._is_view(i, grad):
                    p.grad = grad.clone()
                _bucketed.pop(p, None)
        for hook in self._hooks:
            hook.remove()
        _live_buckets.discard(self)


def buckets_of(optimizer: torch.optim.Optimizer) -> list[GradBucket]:
    """The buckets registered on ``optimizer`` (empty when it has none)."""
    return getattr(optimizer, _REGISTRY_ATTR, [])


def attach_grads_of(optimizer: torch.optim.Optimizer, checked_now: bool = False) -> None:
    """:meth:`GradBucket.attach_grads` for every bucket of ``optimizer``: before a step whose
    grads ``unscale_`` already covered, so that a parameter that received no gradient since
    (``buckets.zero_()`` in between) has ``grad = None``, as in torch. O(1) per bucket when
    every grad is its view and received a gradient. ``checked_now``: the step's own check ran
    just before (no user code in between); a bucket it attached is left as it is. For code
    that dynamo never traces; elsewhere :func:`attach_bucket_grads`."""
    for bucket in buckets_of(optimizer):
        if not (checked_now and bucket.attached):
            bucket.attach_grads()


#: :func:`attach_grads_of` for code that dynamo may trace: host bookkeeping, never in a graph
attach_bucket_grads = never_traced(attach_grads_of)
