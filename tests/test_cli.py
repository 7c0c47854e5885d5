"""The command line (`dsaquant` / `python -m dsaquant`): info, demo on the CPU, --help of every subcommand,
--version."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

BACKENDS = ("reference", "triton", "cuda", "hip")


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("DSAQUANT_BACKEND", None)
    env["CUDA_VISIBLE_DEVICES"] = ""                      # the CPU even where a GPU exists
    return subprocess.run([sys.executable, "-m", "dsaquant", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_info():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for b in BACKENDS:
        row = [ln for ln in lines if re.match(rf"\s+{b}\s", ln)]
        assert len(row) == 1, (b, r.stdout)
        assert "available" in row[0]                          # "available, N ops" or "unavailable: why"
        if "unavailable" in row[0]:
            assert len(row[0].split("unavailable:", 1)[1].strip()) > 0, row[0]
    assert re.search(r"^dsaquant \d+\.\d+\.\d+", r.stdout, re.M)
    assert "chosen for this device: reference" in r.stdout
    # the automatic order (preference.py) on this build's GPU vendor: a CPU or CUDA build reads "nvidia"
    assert re.search(r"^automatic order on (nvidia|amd) GPUs", r.stdout, re.M), r.stdout
    order = {ln.split(":")[0].strip(): ln.split(":", 1)[1].strip() for ln in lines
             if re.match(r"\s+\S.*: \w+ > \w+ > \w+$", ln)}
    if "automatic order on nvidia" in r.stdout:
        assert "index_k_norm_rope_pack_store" not in order                  # the default: cuda first
        assert order["rope_rotate_quant [fp4, 1024 <= T]"] == "triton > cuda > reference"
        assert order["every other op, variant and size"] == "cuda > triton > reference"
    else:
        assert order == {"every other op, variant and size": "hip > triton > reference"}


# the rest runs in-process (a subprocess costs a torch import each)
def test_default_command_is_info(capsys):
    from dsaquant.__main__ import main
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "backends:" in out and all(b in out for b in BACKENDS)


def test_unknown_command(capsys):
    from dsaquant.__main__ import main
    assert main(["frobnicate"]) == 2
    assert "frobnicate" in capsys.readouterr().err


def test_demo_small():
    r = _run("demo", "--tokens", "256", "--heads", "16")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "T=256" in out and "H=16" in out and "backend reference" in out
    header = [ln for ln in out.splitlines() if ln.split()[:3] == ["layout", "cosine", "top512"]]
    assert header, out
    rows = {}
    for ln in out.splitlines():
        parts = ln.split()
        if parts and parts[0] in ("fp8_132", "aiter_fp4", "packed68"):
            rows[parts[0]] = [float(x) for x in parts[1:]]
    assert set(rows) == {"fp8_132", "aiter_fp4", "packed68"}, out
    assert all(len(v) == 4 for v in rows.values())
    assert rows["fp8_132"][0] >= 0.999 and rows["aiter_fp4"][0] >= 0.97
    assert rows["aiter_fp4"][:2] == rows["packed68"][:2]     # the same bytes through two FP4 layouts
    assert all(0.0 <= v[1] <= 1.0 for v in rows.values())


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_demo_forced_unavailable_backend_fails(backend, monkeypatch):
    import dsaquant
    from dsaquant.__main__ import main
    monkeypatch.delenv("DSAQUANT_BACKEND", raising=False)
    with pytest.raises(dsaquant.BackendUnavailable, match=backend):
        main(["demo", "--tokens", "64", "--heads", "16", "--backend", backend, "--device", "cpu"])


def test_help_lists_every_subcommand(capsys):
    from dsaquant.__main__ import COMMANDS, main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dsaquant")
    for name, text in COMMANDS.items():
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), (name, out)
    assert set(COMMANDS) == {"info", "demo", "bench"}


@pytest.mark.parametrize("cmd,options", [("info", []), ("demo", ["--tokens", "--heads", "--backend", "--device"]),
                                         ("bench", ["--tokens", "--heads", "--backends", "--json", "--markdown",
                                                    "--no-v4", "--check"])])
def test_subcommand_help(cmd, options, capsys):
    from dsaquant.__main__ import main
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dsaquant {cmd}")
    for o in options:
        assert re.search(rf"^\s+{o}\b.*\S", out, re.M), (o, out)


def test_version_is_the_one_everywhere(capsys):
    """`dsaquant --version` prints dsaquant.__version__, and pyproject.toml and both plugins declare it."""
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    from pathlib import Path

    import dsaquant
    from dsaquant.__main__ import main
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dsaquant {dsaquant.__version__}"
    root = Path(__file__).resolve().parents[1]
    for path in ("pyproject.toml", "plugins/cuda13/pyproject.toml", "plugins/rocm7/pyproject.toml"):
        meta = tomllib.loads((root / path).read_text())["project"]
        assert meta["version"] == dsaquant.__version__, path
    pins = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert pins["cuda13"] == [f"dsaquant-cuda13=={dsaquant.__version__}"]
    assert pins["rocm7"] == [f"dsaquant-rocm7=={dsaquant.__version__}"]


def test_usage_error_exits_2(capsys):
    from dsaquant.__main__ import main
    assert main(["demo", "--tokens", "many"]) == 2
    assert "--tokens" in capsys.readouterr().err
