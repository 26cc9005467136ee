"""Extension state of :class:`triton_scaler.GradScaler`: the :class:`ScalePolicy`, device
tensors, skip signal, state_dict / load_state_dict and pickling. Kept apart from the step logic."""

from __future__ import annotations

from typing import Any

import torch

from ._backend import Backend
from ._compile import is_traced
from ._warn import warn_at_caller
from .policy import FP32_TINY, INT32_MAX, INT32_MIN, ScalePolicy, as_int, check_scale_value
from .spike_guard import SpikeGuard

EXTENSION_KEYS = ("hysteresis", "_hysteresis_tracker", "consecutive_hysteresis", "min_scale",
                  "max_scale", "raise_at_min_scale", "dynamic", "skip_on_overflow",
                  "skipped_steps")
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_INT64_MAX = 2**63 - 1
#: found_inf flags per iteration, one per optimizer; the last one collects the rare extras
#: (a ninth optimizer, grads on several devices), so update() reduces all of them in one launch.
FOUND_INF_SLOTS = 8


def _state_key(key: str) -> str:
    return f"state_dict[{key!r}]"


def _number_of(value: Any) -> Any:
    """A 0-d tensor as its Python number (torch's ``load_state_dict`` fills the scale from
    one, so such checkpoints exist: one host read each); any other value as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return value.item()
    return value


def _policy_field(field: str) -> Any:  # a property; Any: torch types those it replaces as numbers
    """torch's attribute names (``_growth_factor`` ...) as views of the policy; assigning one
    (torch's own ``__init__`` does) validates and swaps in a new policy."""

    def get(self) -> Any:
        return getattr(self._policy, field)

    def set(self, value: Any) -> None:
        self._set_policy(self._policy.replace(**{field: value}))

    return property(get, set, doc=f"The policy's ``{field}``.")


class ScalerState(torch.amp.GradScaler):
    """:class:`GradScaler`'s state beside torch's: the settings (a :class:`ScalePolicy`), the
    device tensors, the skip signal, checkpoints (state_dict, pickling)."""

    _policy: ScalePolicy
    _backend: Backend  # GradScaler's arguments
    _process_group: Any
    _guard: SpikeGuard | None
    _scaling: bool = True
    #: torch's, narrowed: read only once made (the first ``scale()`` or ``unscale_``)
    _scale: torch.Tensor
    _growth_tracker: torch.Tensor
    _growth_factor = _policy_field("growth_factor")
    _backoff_factor = _policy_field("backoff_factor")
    _growth_interval = _policy_field("growth_interval")

    def _init_extension_state(self) -> None:
        #: what the traced scale() hands the registered before_backward_ op (module _dispatch)
        self._backward_token = torch.empty(0)
        self._init_hysteresis_tracker = self._policy.hysteresis
        self._init_skipped_steps = 0
        self._hysteresis_tracker_state: torch.Tensor | None = None
        self._skipped_steps_t: torch.Tensor | None = None
        self._last_step_skipped: torch.Tensor | None = None
        self._last_step_skipped_bytes: torch.Tensor | None = None
        self._params_t: torch.Tensor | None = None
        self._flags: torch.Tensor | None = None  # the buffer's found_inf part, a view
        self._found_slots: list[torch.Tensor] = []
        self._watch: Any = None  # a GradWatch (telemetry.py) while one is attached
        self._host_spans: list[torch.Tensor] = []  # [scale, flags...][:i + 1] for each i
        self._slots_taken = 0
        self._warned_underflow = False

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """torch's private (Accelerate calls it): ``_scale`` and ``_growth_tracker`` on
        ``dev``, as torch makes them, and the scaler's own device state beside them."""
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32,
                                          device=dev)
        self._init_device_state(dev)

    def _init_device_state(self, dev: torch.device) -> None:
        """The device state beside ``_scale`` and ``_growth_tracker`` (made just before).
        Made in code that torch.compile traces, no views are kept, as a compiled graph's
        outputs may not keep them (torch 2.8's inductor): the flags are then a tensor of
        their own and step()'s host read stacks the scale and a flag."""
        buffered = not is_traced()
        self._slots_taken = 0
        if buffered:
            # One buffer: [scale, found_inf flag per optimizer ...]. update() reads and zeroes
            # the flags in its one launch; step() copies scale and a flag to the host in one read.
            buffer = torch.zeros(1 + FOUND_INF_SLOTS, dtype=torch.float32, device=dev)
            buffer[:1].copy_(self._scale)
            self._scale = buffer[0]
            self._flags = buffer[1:]
            self._found_slots = list(self._flags.unbind())
            # step()'s host read of (scale, a flag): views made once, not a slice per step
            self._host_spans = [buffer[:i + 1] for i in range(1 + FOUND_INF_SLOTS)]
        else:
            self._flags = torch.zeros(FOUND_INF_SLOTS, dtype=torch.float32, device=dev)
            self._found_slots = []
            self._host_spans = []
        self._hysteresis_tracker_state = torch.full((), self._init_hysteresis_tracker,
                                                    dtype=torch.int32, device=dev)
        self._skipped_steps_t = torch.full((), self._init_skipped_steps, dtype=torch.int64,
                                           device=dev)
        self._last_step_skipped = torch.zeros((), dtype=torch.bool, device=dev)
        # what update()'s kernel writes, the flag's byte, viewed once (not a view per step);
        # state made in traced code leaves it to the eager update (torch 2.8's inductor
        # cannot view a bool as uint8)
        self._last_step_skipped_bytes = self._last_step_skipped.view(torch.uint8) \
            if buffered else None
        self._params_t = torch.tensor(self._policy.kernel_values(), dtype=torch.float64,
                                      device=dev)

    def _home(self) -> torch.device:
        """The scaler's device (``"cuda"``: the current CUDA device)."""
        return torch.device(self._device)

    def _check_state(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's ``_check_scale_growth_tracker`` (which traced code cannot call: dynamo
        skips torch.amp): the scale and growth tracker, or torch's error. Made here instead,
        on the scaler's device at ``init_scale`` (the loaded scale after a checkpoint), in the
        guard-only mode and with a ``process_group``: a pipeline stage other than the last
        never calls ``scale()``, and every rank of the group follows the same trajectory."""
        if self._scale is None and (not self._scaling or self._process_group is not None):
            self._lazy_init_scale_growth_tracker(self._home())
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs) "
               "earlier in the iteration.")
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _set_policy(self, policy: ScalePolicy) -> None:
        """Swap in a validated policy; the kernel's parameter buffer is updated in place, so a
        captured CUDA graph sees the new values."""
        self._policy = policy
        params = getattr(self, "_params_t", None)
        if params is not None:
            values = torch.tensor(policy.kernel_values(), dtype=torch.float64, device="cpu")
            if params.is_cuda:  # stream-ordered upload that does not block the host
                values = values.pin_memory()
            params.copy_(values, non_blocking=True)

    def _rezero_written_padding(self) -> None:
        """Zero again the bucket padding that this iteration's unscale may have turned into
        NaN (see :meth:`GradScaler._note_written_padding`): one fill per such bucket."""
        for state in self._per_optimizer_states.values():
            for buffer, padding in state.pop("written_padding", ()):
                buffer.index_fill_(0, padding, 0)

    @property
    def policy(self) -> ScalePolicy:
        """The scale settings (a frozen, validated :class:`ScalePolicy`)."""
        return self._policy

    @property
    def _hysteresis_tracker_t(self) -> torch.Tensor | None:
        """The tracker handed to the update op: None when hysteresis is 1 (torch's rule)."""
        return self._hysteresis_tracker_state if self._policy.hysteresis > 1 else None

    # ---------------------------------------------------------------- public accessors
    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-d bool tensor on the scale's device: whether the last :meth:`update` followed a
        skipped step.

        .. note:: Reading it as a Python bool synchronises; using it on the device does not.
        """
        if self._last_step_skipped is None:
            return torch.zeros((), dtype=torch.bool, device="cpu")
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Total number of skipped steps (saved in the state_dict).

        .. note:: Synchronises with the host when read.
        """
        if not self._enabled or self._skipped_steps_t is None:
            return self._init_skipped_steps
        return int(self._skipped_steps_t.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker_state is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker_state.item())

    def get_scale(self) -> float:
        """The current scale.

        Warns once (``RuntimeWarning``) if the scale is below 2**-126, where the scaled grads
        lose precision (from 2**-128 down every step is skipped), or is not positive.

        Returns:
            The scale as a Python float; 1.0 when disabled.

        .. note:: Synchronises with the host (one read), as torch's.
        """
        scale = super().get_scale()
        if self._enabled:
            self._warn_if_underflowed(scale)
        return scale

    def _warn_if_underflowed(self, scale: float) -> None:
        """Warn once of a scale below float32's smallest normal, at the user's call (the
        ``get_scale()`` or ``step()`` line, whichever read it)."""
        if scale < FP32_TINY and not self._warned_underflow:
            self._warned_underflow = True
            if not scale > 0.0:  # set so through update(new_scale=tensor): not an underflow
                warn_at_caller(
                    f"The loss scale is {scale!r}, not a positive number (set through "
                    "update(new_scale=...)): unscaling multiplies the gradients by 1/scale, which "
                    "then flips their sign (a negative scale) or skips every step (0 or NaN). "
                    "Set a positive scale with update(new_scale=...).", RuntimeWarning)
                return
            warn_at_caller(
                f"The loss scale has underflowed to {scale!r} (below float32's smallest normal "
                f"{FP32_TINY!r}): the scaled gradients lose precision, and from 2**-128 down "
                "inv_scale = 1/scale is inf, so every step is skipped and the scale cannot grow "
                "back. Set min_scale (e.g. min_scale=1.0) to floor the backoff, and look for the "
                "source of the non-finite gradients.",
                RuntimeWarning)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor; takes effect on the device, also inside CUDA graphs.

        Args:
            new_factor: finite, > 1.

        Raises:
            ValueError, TypeError: a bad value (nothing changed).

        .. note:: Does not synchronise (a stream-ordered upload of the settings buffer).
        """
        self._set_policy(self._policy.replace(growth_factor=new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor; takes effect on the device, also inside CUDA graphs.

        Args:
            new_factor: in ``[2**-126, 1)``.

        Raises:
            ValueError, TypeError: a bad value (nothing changed).

        .. note:: Does not synchronise.
        """
        self._set_policy(self._policy.replace(backoff_factor=new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval; takes effect on the device, also inside CUDA graphs.

        Args:
            new_interval: int in ``[1, 2**31 - 1]``.

        Raises:
            ValueError, TypeError: a bad value (nothing changed).

        .. note:: Does not synchronise.
        """
        self._set_policy(self._policy.replace(growth_interval=new_interval))

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, loadable here and into ``torch.amp.GradScaler``.

        Returns:
            torch's five keys plus the extension settings, the hysteresis tracker and the
            skipped-step count, and a spike guard's settings and statistics
            (``"spike_guard"``) when one is on; ``{}`` when disabled.

        .. note:: Synchronises with the host (reads the device state), as torch's.
        """
        state = super().state_dict()
        if not self._enabled:
            return state
        values = {**self._policy.state_items(),
                  "_hysteresis_tracker": self._get_hysteresis_tracker(),
                  "skipped_steps": self.skipped_steps}
        state.update((key, values[key]) for key in EXTENSION_KEYS)
        if self._guard is not None:
            state["spike_guard"] = self._guard.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of ``torch.amp.GradScaler``.

        Every key is validated, with the constructor's rules, before anything changes.
        Unknown keys are ignored, as torch's; torch's dicts keep this instance's extension
        settings. A saved spike guard replaces this scaler's (or becomes its guard); a dict
        without one restarts this scaler's guard at its warm-up. A no-op when disabled.

        Args:
            state_dict: from :meth:`state_dict` of either class.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler), as torch.
            KeyError: one of torch's five keys is missing.
            ValueError, TypeError: a bad value; the error names the key and the scaler is
                untouched.

        .. note:: Does not synchronise (the device state is filled in place), except that a
            dict without ``_hysteresis_tracker`` (torch's) reads this scaler's tracker once,
            and a value saved as a 0-d tensor (torch's scaler loads such a ``scale``) is read
            once.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [key for key in TORCH_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"state_dict lacks {missing}; a GradScaler state_dict has the keys "
                           f"{list(TORCH_KEYS)} (and optionally {list(EXTENSION_KEYS)})")
        state_dict = {key: _number_of(value) for key, value in state_dict.items()}
        settings = {f: state_dict[f] for f in self._policy.state_items() if f in state_dict}
        policy = ScalePolicy.create(settings, name=_state_key, base=self._policy)
        scale = check_scale_value(_state_key("scale"), state_dict["scale"], policy)
        growth_tracker = as_int(_state_key("_growth_tracker"), state_dict["_growth_tracker"],
                                0, INT32_MAX)
        if "_hysteresis_tracker" in state_dict:
            hysteresis_tracker = as_int(
                _state_key("_hysteresis_tracker"), state_dict["_hysteresis_tracker"], INT32_MIN,
                policy.hysteresis, f"an int <= hysteresis ({policy.hysteresis})")
        else:  # torch's dicts have none: keep ours (refilled to a smaller new hysteresis)
            hysteresis_tracker = min(self._get_hysteresis_tracker(), policy.hysteresis)
        skipped = as_int(_state_key("skipped_steps"),
                         state_dict.get("skipped_steps", self._init_skipped_steps), 0, _INT64_MAX)
        guard = self._guard
        if "spike_guard" in state_dict:
            guard = SpikeGuard.from_state_dict(state_dict["spike_guard"],
                                               _state_key("spike_guard"))
        elif guard is not None:  # a checkpoint without one: the guard starts its warm-up
            guard = SpikeGuard(**guard.settings())
        if guard is not None and guard.skips and not policy.skip_on_overflow:
            raise ValueError(f"{_state_key('spike_guard')} skips steps (action='skip') and "
                             "skip_on_overflow is False")
        if not self._scaling and (scale != 1.0 or policy.dynamic):
            raise ValueError(f"{_state_key('scale')} is {scale!r} (dynamic={policy.dynamic}): a "
                             "GradScaler(scaling=False) keeps its scale at 1.0, fixed")
        # Validated: now change everything.
        if self._guard is None:
            self._guard = guard
        elif guard is not None:
            self._guard.load_from(guard)
        self._set_policy(policy)
        self._init_scale = scale
        self._init_growth_tracker = growth_tracker
        self._init_hysteresis_tracker = hysteresis_tracker
        self._init_skipped_steps = skipped
        for tensor, value in ((self._scale, scale), (self._growth_tracker, growth_tracker),
                              (self._hysteresis_tracker_state, hysteresis_tracker),
                              (self._skipped_steps_t, skipped)):
            if tensor is not None:
                tensor.fill_(value)
        self._warned_underflow = False

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_skipped_steps"] = self.skipped_steps
            for key in ("_hysteresis_tracker_state", "_skipped_steps_t", "_last_step_skipped",
                        "_last_step_skipped_bytes", "_params_t", "_flags"):
                state[key] = None
            state["_found_slots"] = []
            state["_host_spans"] = []
            state["_slots_taken"] = 0
        state["_backward_token"] = None  # made again on load: the pickle holds no tensor
        state["_process_group"] = None  # process groups do not pickle; set it again after load
        state["_watch"] = None  # a watch is not the scaler's state (nor in its state_dict)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if state.get("_backward_token") is None:
            self._backward_token = torch.empty(0)
