"""The backend registry and the automatic choice of backend.

Backends: `reference` (torch, any device: the oracle), `triton` (NVIDIA and AMD GPUs; the CPU only under
TRITON_INTERPRET=1 and only when asked for), `cuda` (the compiled NVIDIA module) and `hip` (the compiled
AMD module). A backend is a module that, when imported, calls `register(backend, op, fn)` for each op it
implements. The choice, in order: the op's `backend=` argument, the DSAQUANT_BACKEND environment
variable, then the first available backend that implements the op in the automatic order for the tensors'
device: CPU -> reference; a GPU -> the vendor's order for the op (and the call's size and variant) from the
table in preference.py, by default NVIDIA cuda, triton, reference and AMD hip, triton, reference.
A forced backend that is missing, or that lacks the op, raises BackendUnavailable naming what is missing.
"""
from __future__ import annotations

import importlib
import inspect
import os
import threading
from typing import Callable

import torch

from . import preference

BACKENDS = ("reference", "triton", "cuda", "hip")
_MODULES = {
    "reference": "dsaquant.backends.reference",
    "triton": "dsaquant.backends.triton",
    "cuda": "dsaquant.backends.cuda",
    "hip": "dsaquant.backends.hip",
}

_lock = threading.RLock()
_impls: dict[str, dict[str, Callable]] = {b: {} for b in BACKENDS}
_load_errors: dict[str, str] = {}
_loaded: set[str] = set()


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run here (not built, not importable, or lacking the op)."""


def register(backend: str, op: str, fn: Callable) -> None:
    """Called by a backend module at import: `fn` implements `op` (same arguments as the reference)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    with _lock:
        _impls[backend][op] = fn


def _load(backend: str) -> bool:
    with _lock:
        if backend in _loaded:
            return backend not in _load_errors
        _loaded.add(backend)
        try:
            importlib.import_module(_MODULES[backend])
        except Exception as e:  # an import failure is reported, never raised at import of dsaquant
            _load_errors[backend] = f"{type(e).__name__}: {e}"
            return False
        return True


def available(backend: str) -> tuple[bool, str]:
    """(usable here?, reason if not) for one backend, importing it on first use."""
    if backend not in BACKENDS:
        return False, f"unknown backend {backend!r}; expected one of {BACKENDS}"
    ok = _load(backend)
    return ok, ("" if ok else _load_errors.get(backend, "not importable"))


def ops_of(backend: str) -> list[str]:
    """The ops a backend implements (after loading it)."""
    _load(backend)
    return sorted(_impls[backend])


def vendor() -> str:
    """The GPU vendor this torch build drives: "amd" for a ROCm build, else "nvidia"."""
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def _device_order(device: torch.device, op: str, size: int | None = None,
                  variant: str | None = None) -> tuple[str, ...]:
    if device.type == "cpu":
        return ("reference",)
    return preference.order(vendor(), op, size, variant)


def _device_ok(backend: str, device: torch.device) -> str:
    """'' if `backend` can run on `device`, else why not."""
    if backend == "reference":
        return ""
    if device.type == "cpu":
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return ""
        return f"backend {backend!r} needs GPU tensors, got tensors on {device}"
    if backend == "cuda" and getattr(torch.version, "hip", None):
        return "backend 'cuda' cannot run on a ROCm build of torch; use 'hip'"
    if backend == "hip" and not getattr(torch.version, "hip", None):
        return "backend 'hip' needs a ROCm build of torch and an AMD GPU"
    return ""


@torch.compiler.assume_constant_result
def choose(op: str, device: torch.device, backend: str | None = None, size: int | None = None,
           variant: str | None = None) -> str:
    """Name of the backend that runs `op` on `device`: the argument, else DSAQUANT_BACKEND, else auto, the
    first available backend implementing `op` in preference.order(vendor, op, size, variant) (`size`: the
    call's token count T or preference.size_key(op, T), None if unknown; `variant`: preference.variant of
    the call). A forced backend ignores size and variant. (Under torch.compile the choice is made once at
    trace time and baked into the graph; every argument must then be a constant: see choose_for.)"""
    forced = backend or os.environ.get("DSAQUANT_BACKEND") or None
    if forced:
        where = "backend=" if backend else "DSAQUANT_BACKEND="
        ok, why = available(forced)
        if not ok:
            raise BackendUnavailable(f"{where}{forced!r} was requested but is unavailable: {why}")
        if op not in _impls[forced]:
            raise BackendUnavailable(f"{where}{forced!r} does not implement {op!r}; it has {ops_of(forced)}")
        why = _device_ok(forced, device)
        if why:
            raise BackendUnavailable(f"{where}{forced!r}: {why}")
        return forced
    for b in _device_order(device, op, size, variant):
        if available(b)[0] and op in _impls[b] and not _device_ok(b, device):
            return b
    raise BackendUnavailable(f"no backend implements {op!r} on {device}")


def choose_for(op: str, device: torch.device, backend: str | None, tokens, variant: str | None = None) -> str:
    """choose() for a call of `tokens` tokens (an int, or a SymInt under torch.compile with dynamic
    shapes): passes preference.size_key(op, tokens), a plain int on the same side of every rule bound, so
    that the choice stays a trace-time constant. The op wrappers call this."""
    return choose(op, device, backend, preference.size_key(op, tokens), variant)


def get(backend: str, op: str) -> Callable:
    _load(backend)
    try:
        return _impls[backend][op]
    except KeyError:
        raise BackendUnavailable(f"backend {backend!r} does not implement {op!r}") from None


class _LibraryOp:
    """A `torch.library` custom op whose eager calls skip the custom-op machinery.

    Under torch.compile (and torch.export) the call goes through the registered custom op, so graphs see one
    opaque node with its mutated arguments declared; the raw op stays reachable as torch.ops.dsaquant.<name>
    for opcheck. An eager call runs the implementation directly, then bumps the version counters of the
    mutated tensors as the custom op would (autograd's in-place checks see the writes): torch's Python
    dispatch of a mutating custom op rebuilds the schema's argument list for its default filling and costs
    on the order of 100 µs of host time a call, more than most of these ops take on the GPU.
    """

    def __init__(self, fn: Callable, name: str, mutates_args):
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        params = list(inspect.signature(fn).parameters)
        self._mutated = tuple(params.index(n) for n in mutates_args)

    def register_fake(self, fake: Callable) -> Callable:
        return self.op.register_fake(fake)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        out = self.fn(*args)
        for i in self._mutated:   # one tensor a call: torch 2.4's increment_version takes no list
            if isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return out


def library_op(name: str, *, mutates_args) -> Callable[[Callable], _LibraryOp]:
    """Decorator: `fn` registered as the custom op `name` (torch.library.custom_op's arguments), called
    directly when eager (see _LibraryOp)."""
    return lambda fn: _LibraryOp(fn, name, mutates_args)
