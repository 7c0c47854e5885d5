"""One paged_mqa_logits case, called a few times, for Nsight Compute or compute-sanitizer.

    python dev/scorer_case.py LAYOUT B N CONTEXT [H] [BACKEND]
    ncu --clock-control none --kernel-name regex:paged_logits --launch-skip 1 --launch-count 1 \\
        python dev/scorer_case.py fp8_132 64 1 8192
"""
import sys

import torch

from dsaquant import ops
from dsaquant.triton.scorer import make_scorer_inputs


def main(argv):
    layout, B, N, ctx = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    H = int(argv[4]) if len(argv) > 4 else 64
    backend = argv[5] if len(argv) > 5 else "cuda"
    a = make_scorer_inputs(layout, B, N, H, ctx, device="cuda")
    for _ in range(3):
        ops.paged_mqa_logits(layout=layout, backend=backend, **a)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
