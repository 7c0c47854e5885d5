"""kernels/cuda/topk.h compiles as plain C and C++ with a host compiler, and its DsqTopkArgs has the same
size and field offsets as the ctypes mirror in dsaquant.backends.topk_abi (a host program prints them)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from dsaquant.backends import topk_abi

from conftest import REPO

HEADER = REPO / "kernels" / "cuda" / "topk.h"
FIELDS = [name for name, _ in topk_abi.DsqTopkArgs._fields_]


def _host_layout(tmp_path, compiler, lang):
    src = tmp_path / f"layout.{lang}"
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "topk.h"', "int main(void) {",
             '  printf("size %zu\\n", sizeof(DsqTopkArgs));']
    lines += [f'  printf("{f} %zu\\n", offsetof(DsqTopkArgs, {f}));' for f in FIELDS]
    lines += [f'  printf("max_sort %d\\n", (int)DSQ_TOPK_MAX_SORT);',
              f'  printf("forms %d %d %d\\n", (int)DSQ_TOPK_DECODE_1D, (int)DSQ_TOPK_DECODE_2D, (int)DSQ_TOPK_PREFILL);',
              "  return 0;", "}"]
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / f"layout_{lang}"
    std = "-std=c11" if lang == "c" else "-std=c++17"
    subprocess.run([compiler, std, "-Wall", "-Werror", f"-I{HEADER.parent}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}


@pytest.mark.parametrize("compiler, lang", [("gcc", "c"), ("g++", "cpp")])
def test_struct_layout_matches_ctypes(tmp_path, compiler, lang):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not found")
    got = _host_layout(tmp_path, compiler, lang)
    assert int(got["size"]) == ctypes.sizeof(topk_abi.DsqTopkArgs)
    for f in FIELDS:
        assert int(got[f]) == getattr(topk_abi.DsqTopkArgs, f).offset, f
    assert int(got["max_sort"]) == topk_abi.MAX_SORT
    assert got["forms"] == f"{topk_abi.DECODE_1D} {topk_abi.DECODE_2D} {topk_abi.PREFILL}"


def test_make_args_fills_every_field():
    x = torch.zeros(6, 100)[:, :90]
    ks = torch.zeros(6, dtype=torch.int64)
    out = torch.empty(6, 8, dtype=torch.int32)
    ws = torch.empty(topk_abi.workspace_bytes(6, 90, 8, 3), dtype=torch.uint8)
    a = topk_abi.make_args(x, 8, None, 1, ks, ks, True, out, workspace=ws, chunks=3)
    assert (a.rows, a.L, a.row_stride, a.k, a.form, a.logits_dtype, a.index_dtype, a.relative, a.chunks) == \
        (6, 90, 100, 8, topk_abi.PREFILL, 0, 4, 1, 3)
    assert a.logits == x.data_ptr() and a.out == out.data_ptr() and a.context_lens is None
    assert a.workspace_bytes == 6 * (4098 * 4 + (8 + 8192) * 8)   # histogram + counters, above and bin lists
    c = torch.ones(3, 2, dtype=torch.int32)
    a = topk_abi.make_args(x.to(torch.bfloat16), 8, c, 2, None, None, False, out)
    assert (a.form, a.logits_dtype, a.index_dtype, a.next_n, a.ks, a.workspace_bytes) == \
        (topk_abi.DECODE_2D, 1, 3, 2, None, 0)
