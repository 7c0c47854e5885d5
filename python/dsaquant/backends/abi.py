"""The ctypes mirror of the compiled library's C interface (src/include/dsaquant/abi.h).

Each op has one argument struct; the classes below mirror them field for field (tests check every name,
offset and size against the library's own description, dsq_abi_field). `Library` loads the shared object
(libdsaquant_cuda.so, libdsaquant_hip.so, or the test emulator), declares the entry points and turns a
nonzero return into RuntimeError. No Python headers are involved: one library serves every CPython.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_bool, c_char_p, c_float, c_int, c_int64, c_uint64, c_void_p

ABI_VERSION = 1   # DSQ_ABI_VERSION


class DsqRope(ctypes.Structure):
    _fields_ = [("cos", c_void_p), ("sin", c_void_p), ("row_stride", c_int64), ("max_pos", c_int64),
                ("dtype", c_int), ("pairs", c_bool), ("vec", c_bool)]


class DsqIndexerArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("T", c_int64), ("H", c_int64), ("num_blocks", c_int64), ("P", c_int64),
                ("q", c_void_p), ("q_st", c_int64), ("q_sh", c_int64), ("q_vec", c_bool),
                ("k", c_void_p), ("k_st", c_int64), ("k_vec", c_bool), ("in_dt", c_int),
                ("w", c_void_p), ("w_st", c_int64), ("w_sh", c_int64), ("w_dt", c_int),
                ("w_out", c_void_p), ("w_out_st", c_int64), ("w_out_sh", c_int64), ("w_out_dt", c_int),
                ("q_out", c_void_p), ("q_scale_out", c_void_p), ("kv_cache", c_void_p), ("kv_scale", c_void_p),
                ("slots", c_void_p), ("slots_dt", c_int), ("positions", c_void_p), ("pos_dt", c_int),
                ("norm_w", c_void_p), ("norm_w_dt", c_int), ("norm_b", c_void_p), ("norm_b_dt", c_int),
                ("rope", DsqRope), ("eps", c_float), ("weights_scale", c_float),
                ("fp4", c_bool), ("neox", c_bool), ("compute_all", c_bool), ("preshuffle", c_bool),
                ("ue8m0", c_bool), ("rounding", c_int), ("flavour", c_int), ("err_flag", c_void_p)]


class DsqKStoreArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("T", c_int64), ("num_blocks", c_int64), ("P", c_int64),
                ("k", c_void_p), ("k_st", c_int64), ("k_vec", c_bool), ("in_dt", c_int),
                ("norm_w", c_void_p), ("norm_w_dt", c_int), ("positions", c_void_p), ("pos_dt", c_int),
                ("slots", c_void_p), ("slots_dt", c_int), ("rope", DsqRope), ("compress_ratio", c_int64),
                ("eps", c_float), ("rounding", c_int), ("mode", c_int), ("hadamard", c_bool),
                ("cache", c_void_p), ("cache_scale", c_void_p), ("err_flag", c_void_p)]


class DsqQPackArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("T", c_int64), ("H", c_int64),
                ("q", c_void_p), ("q_st", c_int64), ("q_sh", c_int64), ("q_vec", c_bool), ("in_dt", c_int),
                ("positions", c_void_p), ("pos_dt", c_int), ("rope", DsqRope), ("compress_ratio", c_int64),
                ("rounding", c_int), ("mode", c_int),
                ("w", c_void_p), ("w_st", c_int64), ("w_sh", c_int64), ("w_dt", c_int), ("weight_scale", c_float),
                ("payload", c_void_p), ("exps", c_void_p), ("w_out", c_void_p), ("fq_out", c_void_p),
                ("err_flag", c_void_p)]


class DsqCompressArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("T", c_int64), ("B", c_int64), ("ratio", c_int64), ("R", c_int64),
                ("n_ring", c_int64), ("D", c_int), ("K", c_int), ("overlap", c_bool),
                ("kv", c_void_p), ("kv_st", c_int64), ("score", c_void_p), ("sc_st", c_int64), ("in_dt", c_int),
                ("ape", c_void_p), ("ape_st", c_int64),
                ("state_kv", c_void_p), ("skv_s0", c_int64), ("skv_s1", c_int64),
                ("state_score", c_void_p), ("ssc_s0", c_int64), ("ssc_s1", c_int64),
                ("state_slot", c_void_p), ("cu_seqlens", c_void_p), ("start_pos", c_void_p),
                ("norm_w", c_void_p), ("norm_w_dt", c_int), ("eps", c_float), ("rope", DsqRope),
                ("out_slots", c_void_p), ("cache", c_void_p), ("cache_scale", c_void_p),
                ("num_blocks", c_int64), ("P", c_int64), ("quant_mode", c_int), ("aiter_layout", c_bool),
                ("scale_rule", c_int), ("rounding", c_int), ("ue8m0", c_bool), ("flavour", c_int),
                ("preshuffle", c_bool), ("hadamard", c_bool), ("bf16_after", c_int), ("update_state", c_bool),
                ("err_flag", c_void_p)]


class DsqRotateArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("T", c_int64), ("H", c_int64), ("D", c_int),
                ("x", c_void_p), ("x_st", c_int64), ("x_sh", c_int64), ("in_dt", c_int),
                ("rope", DsqRope), ("positions", c_void_p), ("pos_dt", c_int), ("out_kind", c_int),
                ("out", c_void_p), ("out_st", c_int64), ("out_sh", c_int64), ("out_scale", c_void_p),
                ("group", c_int), ("shuffle", c_bool), ("hadamard", c_bool), ("rounding", c_int),
                ("flavour", c_int), ("err_flag", c_void_p)]


class DsqSelfcheckArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("start", c_uint64), ("count", c_uint64), ("out", c_void_p)]


class DsqExpDsArgs(ctypes.Structure):
    _fields_ = [("device", c_int), ("x", c_void_p), ("y", c_void_p), ("n", c_int64)]


STRUCTS = (DsqRope, DsqIndexerArgs, DsqKStoreArgs, DsqQPackArgs, DsqCompressArgs, DsqRotateArgs, DsqSelfcheckArgs,
           DsqExpDsArgs)
# The dynamic symbols the libraries define, and nothing else (tests/test_cuda_module.py, ci/check_library.py): the C
# interface of abi.h, the top-k kernels (kernels/cuda/topk.h), on NVIDIA the decode scorer (kernels/cuda/scorer.h),
# on AMD the FP4 instruction check (kernels/hip/fp4_selfcheck.hip).
C_INTERFACE = frozenset({"dsq_indexer", "dsq_kstore", "dsq_qpack", "dsq_compress_kv", "dsq_rope_rotate_quant",
                         "dsq_fp8_selfcheck", "dsq_exp_ds", "dsq_abi_version", "dsq_abi_sizeof", "dsq_abi_field",
                         "dsq_error_string", "dsq_device_code", "dsq_kernel_code"})
TOPK_EXPORTS = frozenset({"dsq_topk_indices", "dsq_topk_workspace_bytes", "dsq_topk_plan_chunks"})
CUDA_EXPORTS = C_INTERFACE | TOPK_EXPORTS | {"dsq_paged_mqa_logits", "dsq_paged_mqa_logits_layout", "dsq_mqa_logits"}
HIP_EXPORTS = C_INTERFACE | TOPK_EXPORTS | {"dsq_hip_fp4_selfcheck"}
# Besides those the HIP library exports its kernels (clang keeps a HIP kernel visible whatever -fvisibility says: the
# runtime finds it by name), all in dsaquant's namespaces, and each file's __hip_cuid_ marker.
HIP_KERNEL_SYMBOL = r"^(_ZN\d+dsq\w+|__hip_cuid_[0-9a-f]+)$"
# The shared libraries they may need (readelf -d: NEEDED): glibc's and the C++ runtime's, and on AMD the HIP runtime.
# Never the NVIDIA driver (libcuda.so.1, which the statically linked CUDA runtime opens at run time), a shared CUDA
# runtime, Python or libtorch.
SYSTEM_LIBRARIES = frozenset({"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                              "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"})
HIP_RUNTIME = "libamdhip64.so.7"   # ROCm 7

# op name -> (entry point, argument struct): DSQ_ABI_OPS.
OPS = {"indexer": ("dsq_indexer", DsqIndexerArgs), "kstore": ("dsq_kstore", DsqKStoreArgs),
       "qpack": ("dsq_qpack", DsqQPackArgs), "compress_kv": ("dsq_compress_kv", DsqCompressArgs),
       "rope_rotate_quant": ("dsq_rope_rotate_quant", DsqRotateArgs),
       "fp8_selfcheck": ("dsq_fp8_selfcheck", DsqSelfcheckArgs), "exp_ds": ("dsq_exp_ds", DsqExpDsArgs)}


class Library:
    """A loaded library with the C interface: `launch(op, args, stream)` calls dsq_<op>(&args, stream).

    Entry points the library lacks are left out (`has(op)` says which it has)."""

    def __init__(self, path: str):
        self.path = str(path)
        self.cdll = ctypes.CDLL(self.path)
        self._fns = {}
        for op, (sym, struct) in OPS.items():
            fn = getattr(self.cdll, sym, None)
            if fn is not None:
                fn.argtypes, fn.restype = [POINTER(struct), c_void_p], c_int
                self._fns[op] = fn
        self._error_string = self._optional("dsq_error_string", [c_int], c_char_p)
        self._field = self._optional("dsq_abi_field", [c_char_p, c_int, POINTER(c_int64), POINTER(c_int64)],
                                     c_char_p)
        self._sizeof = self._optional("dsq_abi_sizeof", [c_char_p], c_int64)
        self._device_code = self._optional("dsq_device_code", [], c_char_p)
        self._kernel_code = self._optional("dsq_kernel_code", [c_int, POINTER(c_int), POINTER(c_int)], c_int)
        version = self._optional("dsq_abi_version", [], c_int)
        if version is not None and version() != ABI_VERSION:
            raise ImportError(f"{self.path}: C interface version {version()}, this package expects {ABI_VERSION}")

    def _optional(self, sym, argtypes, restype):
        fn = getattr(self.cdll, sym, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
        return fn

    def has(self, op: str) -> bool:
        return op in self._fns

    def launch(self, op: str, args: ctypes.Structure, stream: int) -> None:
        """dsq_<op>(&args, stream); RuntimeError naming the runtime's error if it returns nonzero. A keyword that
        is no field of the struct (ctypes keeps it as a plain attribute) is a TypeError, before the call."""
        if args.__dict__:
            raise TypeError(f"{type(args).__name__} has no fields {sorted(args.__dict__)}")
        err = self._fns[op](ctypes.byref(args), stream or None)
        if err:
            raise RuntimeError(f"dsaquant: launching {op} failed: {self.error_string(err)}")

    def error_string(self, code: int) -> str:
        text = self._error_string(code).decode() if self._error_string is not None else "?"
        return f"error {code} ({text})"

    def device_code(self) -> list[str]:
        """The device code built into the library (dsq_device_code): e.g. ["sm_90a", "sm_100a", "compute_80"];
        [] where the library does not say."""
        text = self._device_code().decode() if self._device_code is not None else ""
        return [t for t in text.split(";") if t]

    def kernel_code(self, device: int) -> tuple[int, int, int]:
        """(error, ptx, binary) of dsq_kernel_code on `device`: the code that runs the kernels there (error 0), as
        major * 10 + minor of the PTX it was compiled from and of its machine code."""
        if self._kernel_code is None:
            return -1, 0, 0
        ptx, binary = c_int(0), c_int(0)
        err = self._kernel_code(device, ctypes.byref(ptx), ctypes.byref(binary))
        return err, ptx.value, binary.value

    def layout(self, struct_name: str) -> tuple[int, list[tuple[str, int, int]]]:
        """The library's own description of a struct: (sizeof, [(field, offset, size), ...])."""
        size = self._sizeof(struct_name.encode())
        fields, off, sz = [], c_int64(), c_int64()
        while (name := self._field(struct_name.encode(), len(fields), ctypes.byref(off), ctypes.byref(sz))):
            fields.append((name.decode(), off.value, sz.value))
        return size, fields


def mirror_layout(struct: type[ctypes.Structure]) -> tuple[int, list[tuple[str, int, int]]]:
    """The ctypes mirror's (sizeof, [(field, offset, size), ...]), to compare with Library.layout."""
    return ctypes.sizeof(struct), [(n, getattr(struct, n).offset, getattr(struct, n).size) for n, _ in struct._fields_]


def describe_code(targets: list[str], ptx: int, binary: int) -> str:
    """Which of the library's device code runs (docs/wheels.md), from dsq_kernel_code's versions: "cubin sm_90a"
    (machine code built for the GPU's architecture or its family), or "PTX compute_80, JIT-compiled for sm_86"
    (the driver compiled the PTX at load time: ptx < binary)."""
    if ptx < binary:
        return f"PTX compute_{ptx}, JIT-compiled for sm_{binary}"
    name = next((t for t in targets if t.startswith("sm_") and t[3:].rstrip("af") == str(binary)), f"sm_{binary}")
    return f"cubin {name}"
