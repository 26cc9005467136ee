"""Triton kernels of triton_scaler and their launch helpers.

Installed as ``triton_scaler.kernels``. Importing this package imports triton; the rest of
triton_scaler imports it lazily, only when the Triton backend is used. It imports torch and
triton only: what each launch helper takes is described here (``unscale.LaunchPlan``,
``update.PARAMS_LAYOUT``); planning and dispatch live in ``triton_scaler``.
"""

from . import guard, stats
from .unscale import launch_unscale
from .update import launch_update_scale

__all__ = ["guard", "launch_unscale", "launch_update_scale", "stats"]
