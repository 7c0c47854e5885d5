"""The timing loop the writer tuning tools share (tune_writers.py, tune_compress.py, tune_rotate.py): one Markdown
row a backend, the bench's timer (`dsaquant.bench.time_graph`: CUDA-graph medians, 100 calls a graph for T <= 64,
else 20 cycling over the input sets) against the copy rate of the same run."""
import os

from dsaquant import bench


def backends(default: str = "cuda triton") -> list[str]:
    """The backends of TUNE_BACKENDS (default `default`)."""
    return os.environ.get("TUNE_BACKENDS", default).split()


def header(first: str = "case") -> float:
    """Measures and prints the copy rate (GB/s, returned), then the table's header."""
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    print(f"| variant | backend | {first} | T | median µs | % copy |")
    print("|---|---|---|---:|---:|---:|")
    return bw


def time_rows(label: str, name, T: int, fn, sets: list, moved: int, bw: float, names: list[str]) -> None:
    """Times fn(**kwargs, backend=b) over the input sets for each backend b of `names`; prints a row each."""
    for backend in names:
        sec = bench.time_graph(lambda kw: fn(**kw, backend=backend), sets, 100 if T <= 64 else 20)
        print(f"| {label} | {backend} | {name} | {T} | {sec * 1e6:.2f} | {100 * moved / sec / 1e9 / bw:.1f} |",
              flush=True)
