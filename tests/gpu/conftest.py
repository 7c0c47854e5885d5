"""GPU suite: prints (and, with $DSAQUANT_COUNTS_FILE set, saves) the byte-comparison table at the end."""
import os

from .counts import COUNTS, table


def pytest_terminal_summary(terminalreporter):
    if not COUNTS:
        return
    text = table()
    terminalreporter.write_sep("=", "byte-exact comparisons against the reference")
    terminalreporter.write_line(text)
    path = os.environ.get("DSAQUANT_COUNTS_FILE")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")
