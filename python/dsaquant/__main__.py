"""Command line: `python -m dsaquant info | demo | bench`."""
from __future__ import annotations

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "info"
    if cmd == "info":
        from . import info
        from .info import format_info
        print(format_info(info()))
    elif cmd == "demo":
        from .demo import main as demo
        demo(argv)
    elif cmd == "bench":
        from .bench import main as bench
        bench(argv)
    else:
        print(f"unknown command {cmd!r}; use one of: info, demo, bench", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
