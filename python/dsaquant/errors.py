"""Device-side error flags (no host sync in the hot path) and the opt-in synchronous host checks.

Kernels and the reference never write a slot at or past the cache's capacity: they skip it and OR a
code into a per-device int32 flag. `check_errors()` reads (and clears) the flags and raises
`DsaquantError` naming what happened. `set_host_checks(True)` (or DSAQUANT_HOST_CHECKS=1) makes every
op check slot ranges on the host before launching, raising ValueError and writing nothing.
"""
from __future__ import annotations

import os
import threading

import torch

from .codes import ErrFlag

SLOT_OUT_OF_RANGE = int(ErrFlag.slot_out_of_range)
POSITION_OUT_OF_RANGE = int(ErrFlag.position_out_of_range)
PAGE_OUT_OF_RANGE = int(ErrFlag.page_out_of_range)
MESSAGES = {
    SLOT_OUT_OF_RANGE: "a slot id at or past the cache's capacity was skipped (nothing was written for it)",
    POSITION_OUT_OF_RANGE: "a position outside [0, max_pos) of the RoPE table was clamped into it (SPEC §7.5)",
    PAGE_OUT_OF_RANGE: "a position whose page is past the block table, or whose block-table entry is outside "
                       "[0, num_blocks), was not read (a scorer logit of -inf; a gathered key of zeros)",
}

_lock = threading.Lock()
_flags: dict[torch.device, torch.Tensor] = {}
_host_checks = os.environ.get("DSAQUANT_HOST_CHECKS", "0") not in ("", "0", "false", "False")


class DsaquantError(ValueError):
    """Raised by check_errors() when a kernel skipped bad input."""


def flag_tensor(device) -> torch.Tensor:
    """The int32 [1] error flag of `device` (created zeroed on first use; kernels OR codes into it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        f = _flags.get(device)
        if f is None:
            f = torch.zeros(1, dtype=torch.int32, device=device)
            _flags[device] = f
        return f


def flag_if(cond: torch.Tensor, code: int) -> None:
    """OR `code` into the device flag where any element of `cond` is true (no host sync)."""
    if cond.numel() == 0:
        return
    f = flag_tensor(cond.device)
    f.bitwise_or_(cond.any().to(torch.int32) * code)


def check_errors(device=None) -> None:
    """Synchronise, read and clear the error flags (of `device`, or of every device used), and raise
    DsaquantError if any op skipped bad input since the last check."""
    with _lock:
        items = [(d, f) for d, f in _flags.items() if device is None or d == torch.device(device)]
    problems = []
    for d, f in items:
        v = int(f.item())
        if v:
            f.zero_()
            problems += [f"{d}: {msg}" for code, msg in MESSAGES.items() if v & code]
    if problems:
        raise DsaquantError("; ".join(problems))


def set_host_checks(enabled: bool) -> None:
    """Turn the synchronous host-side slot checks on or off (default: DSAQUANT_HOST_CHECKS)."""
    global _host_checks
    _host_checks = bool(enabled)


def host_checks_enabled() -> bool:
    return _host_checks
