"""The peers' scale policies, transcribed from their sources, as test oracles."""

import torch


class MegatronDynamicGradScaler:
    """megatron/core/optimizer/grad_scaler.py: DynamicGradScaler.update (fp32 tensors)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor,
                 growth_interval, hysteresis):
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


class DeepSpeedDynamicLossScaler:
    """deepspeed/runtime/fp16/loss_scaler.py: DynamicLossScaler.update_scale (Python floats)."""

    def __init__(self, init_scale=2**32, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=1, consecutive_hysteresis=False, raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease "
                                    "scale anymore. Exiting run.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def overflow_bursts(steps, seed, p_start=0.08, max_len=4):
    """Random overflow sequence with bursts of consecutive overflows."""
    gen = torch.Generator().manual_seed(seed)
    flags, i = [False] * steps, 0
    while i < steps:
        if torch.rand((), generator=gen).item() < p_start:
            n = int(torch.randint(1, max_len + 1, (), generator=gen))
            for j in range(i, min(steps, i + n)):
                flags[j] = True
            i += n
        i += 1
    return flags


class MindSporeDynamicLossScaler:
    """mindspore/amp.py: DynamicLossScaler.adjust (branch-free, fp32 tensors)."""

    def __init__(self, scale_value, scale_factor, scale_window):
        self.scale_value = torch.tensor(float(scale_value))
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.counter = torch.tensor(0)

    def adjust(self, grads_finite):
        one = torch.ones((), dtype=self.scale_value.dtype)
        scale_mul_factor = self.scale_value * self.scale_factor
        scale_value = torch.where(
            grads_finite,
            torch.where(self.counter == (self.scale_window - 1),
                        torch.where(torch.isfinite(scale_mul_factor), scale_mul_factor,
                                    self.scale_value),
                        self.scale_value),
            torch.maximum(one, self.scale_value / self.scale_factor))
        self.scale_value = scale_value
        self.counter = ((self.counter + 1) % self.scale_window) * grads_finite
        return True


class ApexLossScaler:
    """apex/amp/scaler.py: LossScaler.update_scale (dynamic)."""

    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0**24):
        self._loss_scale = min(max_loss_scale, init_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0

    def update_scale(self, has_overflow):
        if has_overflow:
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0


class ApexAmpOracle:
    """apex/amp/handle.py ``scale_loss`` with _process_optimizer.py's ``prepare_backward`` /
    ``post_backward_models_are_masters`` (fp32 params that are their own masters, apex's O1)
    and scaler.py's ``unscale`` / ``unscale_with_stashed``, on plain tensors: the grads set
    aside at a ``scale_loss`` without ``delay_unscale`` unless a delayed backward left scaled
    grads (``params_have_scaled_gradients``); only the incoming grads checked; one skip decision
    per call, for all its optimizers, kept until a step consumes it (``already_patched``)."""

    def __init__(self, num_losses, init_scale, scale_window):
        self.scalers = [ApexLossScaler(init_scale, scale_window) for _ in range(num_losses)]
        self._stash, self._have_scaled, self._patched = {}, set(), set()

    @staticmethod
    def _params(opt):
        return [p for group in opt.param_groups for p in group["params"]]

    def enter(self, loss_id, opts, delay_unscale):
        """The scale to multiply the loss by; sets the grads aside."""
        if not delay_unscale:
            for opt in opts:
                if id(opt) not in self._have_scaled:
                    self._stash[id(opt)] = [p.grad for p in self._params(opt)]
                    for p in self._params(opt):
                        p.grad = None
        return self.scalers[loss_id]._loss_scale

    def exit(self, loss_id, opts, delay_unscale):
        scaler = self.scalers[loss_id]
        if delay_unscale:
            self._have_scaled.update(map(id, opts))
            return
        inv, overflow = 1.0 / scaler._loss_scale, False
        for opt in opts:
            self._have_scaled.discard(id(opt))
            params = self._params(opt)
            for p, stashed in zip(params, self._stash.pop(id(opt), [None] * len(params))):
                if p.grad is None:
                    p.grad = stashed
                    continue
                overflow |= not bool(torch.isfinite(p.grad).all())
                unscaled = p.grad * torch.tensor(inv, dtype=torch.float32)
                p.grad = unscaled if stashed is None else unscaled + stashed
        scaler.update_scale(overflow)
        if overflow:
            self._patched.update(map(id, opts))

    def step(self, opt):
        """apex's patched ``step``: skipped once after an overflow."""
        if id(opt) in self._patched:
            self._patched.discard(id(opt))
        else:
            opt.step()
