"""triton_scaler: a drop-in ``torch.amp.GradScaler`` with fused Triton kernels.

Importing this package does not import triton; the kernels load on first use.
"""

from . import ops
from .buckets import GradBuckets
from .grad_scaler import GradScaler, MinScaleReachedError
from .ops import all_finite
from .policy import ScalePolicy, ScalerArgumentError
from .schedulers import SkipAwareScheduler
from .sharded import ShardedGradScaler
from .spike_guard import SpikeGuard
from .telemetry import GradWatch, SkippedStepsError, WatchReport

__all__ = ["GradScaler", "GradBuckets", "GradWatch", "MinScaleReachedError", "ScalePolicy",
           "ScalerArgumentError", "ShardedGradScaler", "SkipAwareScheduler", "SkippedStepsError",
           "SpikeGuard", "WatchReport", "all_finite", "ops"]
__version__ = "0.1.0"
