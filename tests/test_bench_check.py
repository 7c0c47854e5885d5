"""The bench's automatic-choice check (bench.auto_check, bench.format_auto_check) and its table format, on
synthetic rows: no GPU, no timing."""
from __future__ import annotations

import pytest

from dsaquant import bench


def _row(op, tokens, backend, us, auto, **kw):
    return dict(op=op, tokens=tokens, heads=64, backend=backend, us=us, auto=auto, gb_s=1.0, pct_copy=1.0,
                pct_read=1.0, bytes=1, timing="graph x20", **kw)


def test_groups_by_op_and_size_and_flags_a_slow_auto():
    rows = [_row("q pack", 64, "cuda", 4.63, "cuda"), _row("q pack", 64, "triton", 3.59, "cuda"),
            _row("q pack", 64, "reference", 1891.0, "cuda"),
            _row("q pack", 1, "cuda", 3.47, "cuda"), _row("q pack", 1, "triton", 3.49, "cuda"),
            _row("k store", 64, "cuda", 4.41, "triton"), _row("k store", 64, "triton", 4.21, "triton")]
    c = bench.auto_check(rows)
    assert c["tolerance"] == pytest.approx(0.10)
    g = {(x["op"], x["tokens"]): x for x in c["groups"]}
    assert set(g) == {("q pack", 64), ("q pack", 1), ("k store", 64)}
    slow = g[("q pack", 64)]
    assert slow["flagged"] and slow["auto"] == "cuda" and slow["fastest"] == "triton"
    assert slow["auto_us"] == 4.63 and slow["fastest_us"] == 3.59
    assert slow["slower"] == pytest.approx(4.63 / 3.59 - 1)
    assert not g[("q pack", 1)]["flagged"] and g[("q pack", 1)]["slower"] == 0.0          # auto is the fastest
    assert not g[("k store", 64)]["flagged"]
    assert c["flagged"] == 1 and c["passed"] is False


def test_within_tolerance_passes_and_the_bound_is_strict():
    rows = [_row("op", 8192, "cuda", 1.10, "cuda"), _row("op", 8192, "triton", 1.0, "cuda"),
            _row("op", 64, "cuda", 1.05, "cuda"), _row("op", 64, "triton", 1.0, "cuda")]
    c = bench.auto_check(rows, tolerance=0.10)
    assert c["passed"] and c["flagged"] == 0
    assert not bench.auto_check(rows, tolerance=0.02)["passed"]


def test_auto_not_measured_is_not_flagged():
    rows = [_row("op", 64, "triton", 1.0, "cuda"), _row("op2", 64, "triton", 1.0, None)]
    c = bench.auto_check(rows)
    assert c["passed"]
    assert [(g["auto"], g["auto_us"], g["slower"], g["flagged"]) for g in c["groups"]] == \
        [("cuda", None, None, False), (None, None, None, False)]


def test_scorer_rows_group_by_their_shape():
    def s(ctx, backend, us):
        return dict(op="paged_mqa_logits fp8_132", batch=64, next_n=1, context=ctx, heads=64, contexts="full",
                    backend=backend, us=us, auto="cuda")
    rows = [s(8192, "cuda", 24.9), s(8192, "triton", 66.7), s(32768, "cuda", 90.0), s(32768, "triton", 80.0)]
    c = bench.auto_check(rows)
    assert len(c["groups"]) == 2
    flagged = [g for g in c["groups"] if g["flagged"]]
    assert [g["context"] for g in flagged] == [32768] and "tokens" not in flagged[0]


def test_empty_rows_pass():
    assert bench.auto_check([]) == dict(tolerance=bench.AUTO_TOLERANCE, groups=[], flagged=0, passed=True)


def test_format_auto_check_ends_with_the_summary():
    rows = [_row("q pack", 64, "cuda", 4.63, "cuda"), _row("q pack", 64, "triton", 3.59, "cuda"),
            _row("k store", 64, "triton", 4.21, "triton")]
    lines = bench.format_auto_check(bench.auto_check(rows))
    assert lines[0].startswith("| op | size | auto |")
    assert any("| q pack | tokens 64, heads 64 | cuda | 4.63 | triton | 3.59 | 29.0 | SLOWER |" == ln for ln in lines)
    assert lines[-1].startswith("automatic choice check: FAILED (1 of 2 groups")
    ok = bench.format_auto_check(bench.auto_check(rows[1:]))
    assert ok[-1].startswith("automatic choice check: passed (0 of 2 groups")


def test_format_table_has_the_read_column_and_the_check():
    rows = [_row("q pack", 64, "cuda", 4.63, "cuda"), _row("q pack", 64, "triton", 3.59, "cuda")]
    res = dict(copy_gb_s=4249.0, hbm_read_gb_s=4250.0, device="GPU", rows=rows, scorer=[], prefill=[],
               auto_check=bench.auto_check(rows))
    text = bench.format_table(res)
    assert "HBM read (read-only reduction): 4250 GB/s" in text
    assert "| op | tokens | backend | auto | median µs | GB/s | % copy | % HBM read | timing |" in text
    assert text.splitlines()[-1].startswith("automatic choice check: FAILED")
    # results written before the read column and the check still format
    old = dict(copy_gb_s=4249.0, device="GPU", rows=[{k: v for k, v in r.items() if k not in ("pct_read", "auto")}
                                                     for r in rows], scorer=[])
    assert "| q pack | 64 | cuda | - | 4.63 |" in bench.format_table(old)


def test_writer_rows_carry_the_variant_the_op_wrappers_pass():
    # the bench's automatic pick must see the variant the op's wrapper gives dispatch (ops.py, compress.py)
    got = {label: (op, variant) for label, op, _, _, _, variant in bench.cases(8, 64)}
    assert got["indexer FP8"] == ("indexer_qk_rope_quant_and_cache", "fp8")
    assert got["indexer FP4"] == ("indexer_qk_rope_quant_and_cache", "fp4")
    assert got["q pack weights (v41)"] == ("index_q_rope_pack_weights", None)
    v4 = {(label, T): variant for label, T, _, _, _, _, variant in bench.v4_cases((64, 8192))}
    assert v4[("compress_kv prefill r128 fp4", 8192)] == "ratio=128" and v4[("compress_kv prefill r4 fp4", 64)] == "ratio=4"
    assert v4[("rope_rotate_quant fp4 H=64", 64)] == "fp4" and len(v4) == 7
