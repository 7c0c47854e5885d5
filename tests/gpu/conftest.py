"""GPU suite: prints (and, with $DSAQUANT_COUNTS_FILE set, saves) the byte-comparison table at the end."""
import os

import pytest
import torch

from .counts import COUNTS, table


@pytest.fixture(autouse=True)
def _ieee_reference():
    """The reference backend's matrix products (the scorer's einsum) must not use TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


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
