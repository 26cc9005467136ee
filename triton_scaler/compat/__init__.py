"""Scaler interfaces of other frameworks, as thin adapters over triton_scaler's device ops.

* :mod:`triton_scaler.compat.deepspeed`: ``LossScaler``, ``DynamicLossScaler``,
  ``CreateLossScaler``.
* :mod:`triton_scaler.compat.mindspore`: ``StaticLossScaler``, ``DynamicLossScaler``,
  ``all_finite``, ``FixedLossScaleManager``, ``DynamicLossScaleManager``.
* :mod:`triton_scaler.compat.apex`: ``Amp`` (``scale_loss`` context manager).
* :mod:`triton_scaler.compat.megatron`: ``DynamicGradScaler``, ``ConstantGradScaler``
  (a Megatron-core optimizer's ``grad_scaler``).
"""
