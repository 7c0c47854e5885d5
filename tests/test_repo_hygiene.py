"""The repository reads as a product: every "SPEC §N" citation names a section of docs/spec.md, no tracked
file links outside the repository, and no tracked file carries development-log remarks (when or on which
device call a number was produced, issue numbers, device time). Runs on `git ls-files` (skipped outside a git checkout)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec.md"
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def _text_files() -> dict[str, str]:
    files = {}
    for p in _tracked():
        data = (ROOT / p).read_bytes()
        if b"\0" in data[:8192]:
            continue                                   # binary
        files[p] = data.decode("utf-8", errors="replace")
    return files


def spec_sections(text: str) -> set[str]:
    """Section ids of spec.md: "N" for "## N. ...", "N.M" for "### N.M ...", and "0.K" for rule K of §0."""
    ids = set(re.findall(r"^## (\d+)\.", text, re.M)) | set(re.findall(r"^### (\d+\.\d+)\b", text, re.M))
    s0 = re.search(r"^## 0\..*?(?=^## )", text, re.M | re.S)
    if s0:
        ids |= {f"0.{k}" for k in re.findall(r"^(\d+)\. ", s0.group(0), re.M)}
    return ids


CITATION = re.compile(r"§\s?(\d+(?:\.\d+)?)")


def test_spec_has_the_numbered_sections():
    ids = spec_sections(SPEC.read_text())
    assert {str(n) for n in range(9)} <= ids
    assert {f"7.{k}" for k in range(1, 8)} <= ids and {f"0.{k}" for k in range(1, 8)} <= ids
    assert re.search(r'"SPEC §N".*this file', SPEC.read_text(), re.S)


def test_every_spec_citation_resolves():
    ids = spec_sections(SPEC.read_text())
    bad = [f"{p}:{text.count(chr(10), 0, m.start()) + 1}: §{m.group(1)}"
           for p, text in _text_files().items() if p != THIS
           for m in CITATION.finditer(text) if m.group(1) not in ids]
    assert not bad, "citations of sections docs/spec.md does not have:\n" + "\n".join(bad)


def test_the_citation_check_catches_a_missing_section():
    ids = spec_sections(SPEC.read_text())
    assert [m.group(1) for m in CITATION.finditer("SPEC §7.9 and §3")] == ["7.9", "3"]
    assert "7.9" not in ids and "3" in ids and "9" not in ids


# ---- links ---------------------------------------------------------------------------------------------------
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|/work/|SPEC\.md")
URL = re.compile(r"https?://")
# CI workflow steps download toolchains (commands, not links); the license text names its own home.
URL_ALLOWED = re.compile(r"^(ci/workflows/.*\.yml|LICENSE)$")


def link_problems(path: str, text: str) -> list[str]:
    out = []
    for m in OUTSIDE.finditer(text):
        out.append(f"{path}: refers outside the repository ({m.group(0)!r})")
    if not URL_ALLOWED.match(path):
        out += [f"{path}: external URL" for _ in URL.finditer(text)]
    if path.endswith(".md"):
        for m in MD_LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or URL.match(target):
                continue
            resolved = (ROOT / path).parent.joinpath(target).resolve()
            if ROOT not in resolved.parents and resolved != ROOT:
                out.append(f"{path}: link {m.group(1)!r} leaves the repository")
            elif not resolved.exists():
                out.append(f"{path}: link {m.group(1)!r} points at nothing")
    return out


def test_no_link_leaves_the_repository():
    bad = [b for p, text in _text_files().items() if p != THIS for b in link_problems(p, text)]
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_bad_links():
    assert link_problems("README.md", "the [SPEC](../shared/SPEC.md)")
    assert link_problems("docs/x.md", "[a](../../outside.md)")
    assert link_problems("docs/x.md", "[a](missing.md)")
    assert link_problems("python/x.py", "see /work/main/notes")
    assert link_problems("docs/x.md", "[a](https://example.org)")
    assert not link_problems("docs/x.md", "[spec](spec.md#6-cache-layouts) and [readme](../README.md)")


# ---- development-log remarks ------------------------------------------------------------------------------
DEVLOG = [re.compile(p, re.I) for p in (
    r"\bsessions? ?#?\d",                               # "session 6"
    r"\b(earlier|previous|last|this|next|one) sessions?\b(?! fixture)",
    r"\bruns? #?\d+\b(?! (tests?|times|cases|calls)\b)",   # "run 6" of a device, not "run 2 tests"
    r"\brun\d+_\w+",                                     # raw per-run file names
    r"\bissues? ?#?\d+",
    r"\bdevice[- ]minutes?\b",
    r"\bdevice calls?\b",
    r"\bsitting\b",
    r"\bh200-\d{4}-\d\d-\d\d",                           # the raw result folders
    r"\bNOTES\.md\b",
)]


def devlog_problems(path: str, text: str) -> list[str]:
    return [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for rx in DEVLOG for m in rx.finditer(text)]


def test_no_development_log_remarks():
    bad = [b for p, text in _text_files().items() if p != THIS for b in devlog_problems(p, text)]
    assert not bad, "development-log remarks (say what the code does instead):\n" + "\n".join(bad)


@pytest.mark.parametrize("remark", ["measured in session 6", "H200 run 7: 49 us", "see issue #5", "issue 4 grid",
                                    "28 of 30 device minutes", "in one device call", "run6_bench.json",
                                    "results/h200-2026-11-29-s6/", "the earlier sessions", "NOTES.md"])
def test_the_devlog_check_catches(remark):
    assert devlog_problems("x.py", remark), remark


@pytest.mark.parametrize("prose", ["run 2 tests side by side", "a session fixture", "CUDA-graph replays",
                                   "dsaquant.check_errors() after the run", "device time only"])
def test_the_devlog_check_lets_prose_through(prose):
    assert not devlog_problems("x.py", prose), prose


def test_slow_files_exist():
    """Every file the `slow` marker names exists (a renamed file would silently join the quick subset)."""
    import conftest
    missing = sorted(n for n in conftest.SLOW_FILES if not (ROOT / "tests" / n).is_file())
    assert not missing, missing
