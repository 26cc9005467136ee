"""Device-to-host copies that the host reads later, without waiting for them now."""

from __future__ import annotations

import torch


def copy_to_host_async(src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Start copying the CUDA tensor ``src`` into new pinned host memory; returns
    ``(host, event)``: ``host`` holds ``src``'s values once ``event`` has completed
    (``event.synchronize()``, ``event.query()``). Does not synchronise.

    torch runs a device-to-host copy on the current stream of the *source's* device, so the
    event is recorded on that stream. Recorded on the current device's stream instead
    (``Event().record()``), it would complete without waiting for the copy when ``src`` lives
    on another device (grads on ``cuda:1`` while ``cuda:0`` is current), and the host would
    read the pinned memory before the copy has landed."""
    host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
    host.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(src.device))
    return host, event
