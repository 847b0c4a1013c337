"""A minimal warp-specialized Gluon kernel (a default partition and one worker partition that each write their own
global output, no shared memory of their own) for `compute-sanitizer --tool racecheck`: if racecheck reports hazards
here too, the ones it reports for interpreter v10 at its `def` and `gl.warp_specialize` lines (docs/perf-notes.md) come
from Triton's warp-specialization code, not from the interpreter's ops.

    compute-sanitizer --tool racecheck python scripts/racecheck_ws_minimal.py
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(out_ptr, n, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, 256, layout=lay)
    gl.store(out_ptr + gl.program_id(0) * 256 + offs, offs + n)


@gluon.jit
def _worker(out_ptr, n):
    gl.store(out_ptr + gl.program_id(0), n)


@gluon.jit
def ws_kernel(out_ptr, flag_ptr, n, num_warps: gl.constexpr):
    gl.warp_specialize([(_default, (out_ptr, n, num_warps)), (_worker, (flag_ptr, n))], [1], [32])


def main() -> int:
    out = torch.zeros(4 * 256, dtype=torch.int32, device="cuda")
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    ws_kernel[(4,)](out, flag, 7, num_warps=8)
    torch.cuda.synchronize()
    ok = bool((out.view(4, 256) == torch.arange(256, device="cuda") + 7).all() and (flag == 7).all())
    print("OK" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
