"""One vocabulary: the integer codes of python/dsaquant/codes.py and src/include/dsaquant/codes.h are the same,
enum by enum and name by name. A tiny host program compiled with g++ prints every C++ code through the header's
own X-macro tables and, separately, every Python member looked up by name in the C++ enums (a missing name does not
compile); both listings must equal the Python enums exactly. Also: the Python modules take their option tuples
and codes from codes.py."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsaquant import codes

REPO = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")
PY_CODES = {(e.__name__, m.name): int(m) for e in codes.ENUMS for m in e}


def _printer() -> str:
    lookups = "\n".join(f'  std::printf("lookup %s %s %d\\n", "{e}", "{m}", dsq::code(dsq::{e}::{m}));'
                        for e, m in PY_CODES)
    return f'''#include <cstdio>
#include "dsaquant/codes.h"
#define MEMBER_(m, v) std::printf("table %s %s %d\\n", enum_name, #m, v);
#define ENUM_(E) {{ const char* enum_name = #E; DSQ_CODES_##E(MEMBER_) }}
int main() {{
  DSQ_CODE_ENUMS(ENUM_)
{lookups}
  return 0;
}}
'''


@pytest.fixture(scope="module")
def cpp_codes(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("codes")
    (d / "codes.cpp").write_text(_printer())
    res = subprocess.run([CXX, "-std=c++17", "-Wall", "-Werror", f"-I{REPO / 'src/include'}", str(d / "codes.cpp"),
                          "-o", str(d / "codes")], capture_output=True, text=True)
    assert res.returncode == 0, f"a Python code has no C++ counterpart of that name:\n{res.stderr}"
    out = subprocess.run([str(d / "codes")], capture_output=True, text=True, check=True).stdout
    rows = {"table": {}, "lookup": {}}
    for line in out.splitlines():
        kind, enum, member, value = line.split()
        assert (enum, member) not in rows[kind], f"{enum}.{member} listed twice"
        rows[kind][(enum, member)] = int(value)
    return rows


def test_cpp_tables_equal_python_enums(cpp_codes):
    table = cpp_codes["table"]
    assert set(table) == set(PY_CODES), (f"only in C++: {sorted(set(table) - set(PY_CODES))}; "
                                         f"only in Python: {sorted(set(PY_CODES) - set(table))}")
    bad = {k: (table[k], PY_CODES[k]) for k in PY_CODES if table[k] != PY_CODES[k]}
    assert not bad, f"(C++, Python) values differ: {bad}"


def test_cpp_enums_by_python_names(cpp_codes):
    assert cpp_codes["lookup"] == PY_CODES


def test_values_the_interface_fixes():
    assert [int(codes.Layout[n]) for n in ("fp8_132", "packed68", "aiter_fp4")] == [0, 1, 2]
    assert [int(codes.Fp8Flavour[n]) for n in ("e4m3fn", "e4m3fnuz")] == [0, 1]
    assert [int(codes.DType[n]) for n in ("f32", "bf16", "f16", "i32", "i64")] == [0, 1, 2, 3, 4]
    for enum in codes.ENUMS:   # no two members share a value (IntEnum would make one an alias)
        assert len(enum.__members__) == len(set(map(int, enum))), enum


def test_python_modules_use_the_codes():
    import torch

    from dsaquant import constants, errors, ops
    from dsaquant.reference import fp4
    from dsaquant.triton import formats, scorer
    assert fp4.POLICIES == codes.ROUNDINGS == ("threshold", "rne", "hardware")
    assert fp4.SCALE_RULES == codes.SCALE_RULES == ("pack", "recip")
    assert ops.LAYOUTS == constants.LAYOUTS == codes.LAYOUTS
    assert [r.value for r in constants.Rounding] == list(codes.ROUNDINGS)
    assert errors.SLOT_OUT_OF_RANGE == codes.ErrFlag.slot_out_of_range
    assert errors.POSITION_OUT_OF_RANGE == codes.ErrFlag.position_out_of_range
    assert formats.ROUND_HARDWARE.value == codes.Rounding.hardware and formats.RULE_RECIP.value == codes.ScaleRule.recip
    assert formats.KIND_BF16.value == codes.dtype_code(torch.bfloat16)
    assert scorer.LAYOUT_PACKED68.value == codes.Layout.packed68


def test_code_of_and_dtype_code():
    import torch
    assert codes.code_of(codes.Rounding, "hardware") == 2 and codes.code_of(codes.Rounding, codes.Rounding.rne) == 1
    with pytest.raises(ValueError, match="Rounding: expected one of"):
        codes.code_of(codes.Rounding, "nearest")
    assert codes.dtype_code(torch.int64) == 4
    with pytest.raises(TypeError, match="no kernel code"):
        codes.dtype_code(torch.uint8)
