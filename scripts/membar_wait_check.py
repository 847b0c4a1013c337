"""Does Triton put a CTA barrier before an mbarrier wait in a loop? (perf notes, v10 third session)

Compiles a small Gluon kernel for sm_90 on any machine (no GPU) in three forms and counts `bar.sync 0` in the loop
body of its PTX: a loop that waits on an mbarrier array and reads a shared-memory slot (the v10 compute warps'
pattern), the same loop with the wait done through a named barrier in inline asm, and the loop without any wait.

    python scripts/membar_wait_check.py
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

FORMS = {0: "mbarrier.wait", 1: "named barrier (inline asm)", 2: "no wait"}


@gluon.jit
def _loop(out_ptr, n, FORM: gl.constexpr, num_warps: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [4, 16, 256],
                                     gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(ready.index(i), count=1)
    acc = gl.zeros([16, 256], gl.float32, blk)
    for t in range(n):
        s = t % 4
        if FORM == 0:
            mbarrier.wait(ready.index(s), (t // 4) & 1)
        elif FORM == 1:
            gl.inline_asm_elementwise("bar.sync $1, 288; mov.u32 $0, 0;", "=r,r", [s + 2], dtype=gl.int32,
                                      is_pure=False, pack=1)
        acc += ring.index(s).load(blk).to(gl.float32)
    gl.store(out_ptr + gl.arange(0, 16, layout=gl.SliceLayout(1, blk)), gl.sum(acc, axis=1))


def main() -> int:
    for form, name in FORMS.items():
        src = GluonASTSource(_loop, signature={"out_ptr": "*fp32", "n": "i32", "FORM": "constexpr",
                                               "num_warps": "constexpr"}, constexprs={"FORM": form, "num_warps": 8})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        body = ptx[ptx.index("Loop Header"):]
        body = body[:re.search(r"bra(\.uni)?\s+\$L__BB", body).start()]  # up to the loop's first branch to a block
        count = len(re.findall(r"bar\.sync\s+0;", body))
        print(f"{name:28s} CTA barriers (bar.sync 0) in the loop body: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
