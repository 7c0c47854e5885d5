"""Command line: `dsaquant [--version] {info,demo,bench} [options]` (also `python -m dsaquant ...`).

With no subcommand it runs `info`. Returns the exit status (0, or 2 for a usage error) instead of exiting,
so that tests and the console script (which passes it to sys.exit) share one entry point."""
from __future__ import annotations

import argparse
import sys

from .version import __version__

COMMANDS = {
    "info": "print the backends found here, the one chosen for this machine's device, the automatic order per op, "
            "and the versions",
    "demo": "one indexer step (FP8 and FP4 caches, scored) against an unquantized bf16 truth; runs on the CPU",
    "bench": "time each op on each GPU backend against the copy and HBM-read rates measured in the same run, and "
             "check the automatic choice against the fastest (needs a GPU)",
}


def parser() -> argparse.ArgumentParser:
    from . import bench, demo
    p = argparse.ArgumentParser(prog="dsaquant", description="dsaquant: the DeepSeek Sparse Attention indexer's "
                                "quantization and scoring ops, one set of bytes on every backend.")
    p.add_argument("--version", action="version", version=f"dsaquant {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, text in COMMANDS.items():
        sp = sub.add_parser(name, help=text, description=text)
        if name == "demo":
            demo.add_arguments(sp)
        elif name == "bench":
            bench.add_arguments(sp)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parser().parse_args(argv or ["info"])
    except SystemExit as e:           # --help, --version (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    if a.command in (None, "info"):
        from .info import format_info, info
        print(format_info(info()))
    elif a.command == "demo":
        from .demo import show
        show(a)
    else:
        from .bench import show
        return show(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
