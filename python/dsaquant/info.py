"""dsaquant.info(): which backends exist here, which one each device gets, and the versions."""
from __future__ import annotations

import platform

import torch

from . import dispatch, preference
from .version import __version__


def info() -> dict:
    """A dict: version, torch/triton versions, device, each backend's availability (and why not), the
    ops it implements, the backend chosen automatically for this machine's default device, and the
    automatic order on this torch build's GPU vendor ("vendor", "auto_order": one line per op with a rule,
    then the default order; preference.py)."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton is optional
        triton_version = None
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        device = f"{props.name} ({arch})"
    else:
        dev, device = torch.device("cpu"), f"CPU ({platform.machine()})"
    backends = {}
    for b in dispatch.BACKENDS:
        ok, why = dispatch.available(b)
        backends[b] = {"available": ok, "reason": why, "ops": dispatch.ops_of(b) if ok else []}
        if ok and b in ("cuda", "hip"):
            backends[b]["device_code"] = device_code(b, dev)
    try:
        chosen = dispatch.choose("indexer_qk_rope_quant_and_cache", dev)
    except dispatch.BackendUnavailable as e:
        chosen = f"none ({e})"
    return {
        "dsaquant": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None), "triton": triton_version,
        "device": device, "backends": backends, "chosen": chosen,
        "vendor": dispatch.vendor(), "auto_order": preference.describe(dispatch.vendor()),
    }


def device_code(backend: str, dev: torch.device) -> str | None:
    """The device code in a compiled backend's library (e.g. "sm_90a;sm_100a;compute_80") and, on an NVIDIA GPU,
    which of it runs there: "cubin sm_90a", or "PTX compute_80, JIT-compiled for sm_86" (docs/wheels.md). None
    where the backend has no compiled library."""
    from .backends import compiled
    from .backends.abi import describe_code
    try:
        lib = compiled.library(backend)
    except KeyError:
        return None
    targets = lib.device_code()
    text = ";".join(targets) or "not recorded"
    if backend == "cuda" and dev.type == "cuda" and not getattr(torch.version, "hip", None):
        err, ptx, binary = lib.kernel_code(dev.index)
        runs = describe_code(targets, ptx, binary) if err == 0 else f"none ({lib.error_string(err)})"
        text += f"; on this GPU: {runs}"
    return text


def format_info(d: dict) -> str:
    lines = [f"dsaquant {d['dsaquant']}  python {d['python']}  torch {d['torch']}  triton {d['triton']}",
             f"device: {d['device']}   (torch cuda {d['torch_cuda']}, hip {d['torch_hip']})", "backends:"]
    for b, v in d["backends"].items():
        state = f"available, {len(v['ops'])} ops" if v["available"] else f"unavailable: {v['reason']}"
        lines.append(f"  {b:<10} {state}")
        if v.get("device_code"):
            lines.append(f"  {'':<10} device code: {v['device_code']}")
    lines.append(f"chosen for this device: {d['chosen']}")
    lines.append(f"automatic order on {d['vendor']} GPUs (first available backend implementing the op; "
                 f"CPU tensors: reference):")
    lines += [f"  {ln}" for ln in d["auto_order"]]
    return "\n".join(lines)
