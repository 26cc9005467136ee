"""Triton kernels of triton_scaler and their launch helpers.

Installed as ``triton_scaler.kernels``. Importing this package imports triton; the rest of
triton_scaler imports it lazily, only when the Triton backend is used.
"""

from .plan import UnscalePlan, refuse_overlapping_writes
from .unscale import launch_unscale, plan_unscale
from .update import bind_update_scale

__all__ = ["UnscalePlan", "bind_update_scale", "launch_unscale", "plan_unscale",
           "refuse_overlapping_writes"]
