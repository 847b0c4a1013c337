"""The PTX both interpreters run through inline asm: the counter protocol (acquire polls, release adds), the clocks
(`%globaltimer`, `%smid`) and the L2 bulk prefetch, as Triton device functions for interpreter v9 (kernels/gpu/v9.py,
kernels/gpu/ops.py) and as Gluon device functions (`gl_*`) for interpreter v10 (kernels/gpu/stream.py).

One module so that both interpreters speak the same protocol: a counter is an int32 in global memory, a producer adds
to it once per CTA with a release at GPU scope after a CTA barrier, a consumer polls it with acquire loads at GPU
scope until it reaches the value it needs; everything the producer wrote before its release is then visible.

Under Triton's CPU interpreter (`TRITON_INTERPRET=1`, which runs no inline PTX) the Triton functions are plain
equivalents; programs run one after another there, so only single-worker schedules can be interpreted. The Gluon
functions are only compiled for the GPU.
"""

from __future__ import annotations

import os
import re

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# constexpr: a jit function may only read constexpr globals
ASM_GLOBALTIMER = tl.constexpr("mov.u64 $0, %globaltimer;")
ASM_EX2_FTZ = tl.constexpr("ex2.approx.ftz.f32 $0, $1;")
ASM_SMID = tl.constexpr("mov.u32 $0, %smid;")
#: Two bf16 (one 32-bit register, element 0 in the low half) widened to fp32 bit patterns: a shift and an AND, where
#: the compiler's conversion spends a PRMT and a shift on the high half.
ASM_BF16X2_TO_F32 = tl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }")
ASM_LOAD_ACQUIRE = tl.constexpr("ld.acquire.gpu.global.b32 $0, [$1];")
#: The same load by the first warp of the CTA only; every other thread reads INT32_MAX (so never waits) and waits at
#: the CTA barrier that must follow. Interpreter v10 polls this way: one request per SM and poll round on a counter
#: every worker of a stage waits on, instead of one per warp all queueing at the L2 slice that holds the counter.
ASM_LOAD_ACQUIRE_LEAD = tl.constexpr("{ .reg .pred %p<1>; .reg .b32 %t<1>; mov.u32 %t0, %tid.x; "
                                     "setp.lt.u32 %p0, %t0, 32; mov.u32 $0, 2147483647; "
                                     "@%p0 ld.acquire.gpu.global.b32 $0, [$1]; }")
ASM_SIGNAL_RELEASE = tl.constexpr("{ .reg .pred %p<1>; .reg .b32 %t<1>; mov.u32 %t0, %tid.x; setp.eq.u32 %p0, %t0, 0; "
                                  "@%p0 red.release.gpu.global.add.s32 [$1], $2; mov.u32 $0, 0; }")
#: Two adjacent fp16 values += two fp32 values rounded to fp16, as one 32-bit reduction (relaxed, GPU scope), where
#: the compiler's fp16 atomics issue one per element, two to the same word (measured 1.2-1.4x the step). Operands, two
#: elements a call: the pair's addresses (the first's is the pair's, 4-byte aligned), its values, its masks (a masked
#: element adds 0).
ASM_RED_ADD_F16X2 = tl.constexpr("{ .reg .pred %p<1>; .reg .b32 %t<2>; or.b32 %t1, $6, $7; setp.ne.s32 %p0, %t1, 0; "
                                 "cvt.rn.f16x2.f32 %t0, $5, $4; "
                                 "@%p0 red.relaxed.gpu.global.add.noftz.f16x2 [$2], %t0; mov.u32 $0, 0; "
                                 "mov.u32 $1, 0; }")
#: An L2 prefetch of `size` bytes (a positive multiple of 16; none when size <= 0) by the copy engine: no registers,
#: no wait, never faults.
ASM_PREFETCH_L2 = tl.constexpr("{ .reg .pred %p<1>; setp.gt.s32 %p0, $2, 0; "
                               "@%p0 cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")

# -- Triton (interpreter v9) ---------------------------------------------------------------------------------------

if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def globaltimer():
        return tl.full((), 0, tl.int64)

    @triton.jit
    def smid():
        return tl.full((), 0, tl.int32)

    @triton.jit
    def load_acquire(ptr):
        return tl.load(ptr)

    @triton.jit
    def signal_release(ptr, add):
        return tl.atomic_add(ptr, add)

    @triton.jit
    def prefetch_l2(ptrs, size):
        return size

else:

    @triton.jit
    def globaltimer():
        """Nanoseconds from the GPU's global timer (`%globaltimer`)."""
        return tl.inline_asm_elementwise(ASM_GLOBALTIMER, "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def smid():
        """The SM this thread runs on (`%smid`)."""
        return tl.inline_asm_elementwise(ASM_SMID, "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def load_acquire(ptr):
        """Acquire load at GPU scope: later loads of this thread see every write released before the value read."""
        return tl.inline_asm_elementwise(ASM_LOAD_ACQUIRE, "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def signal_release(ptr, add):
        """`*ptr += add` once per CTA (thread 0), with release semantics at GPU scope. Call after a CTA barrier."""
        return tl.inline_asm_elementwise(ASM_SIGNAL_RELEASE, "=r,l,r", [ptr, add], dtype=tl.int32, is_pure=False,
                                         pack=1)

    @triton.jit
    def prefetch_l2(ptrs, size):
        """`cp.async.bulk.prefetch.L2` of `size` bytes from each pointer (see ASM_PREFETCH_L2)."""
        return tl.inline_asm_elementwise(ASM_PREFETCH_L2, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False,
                                         pack=1)


# -- Gluon (interpreter v10) ---------------------------------------------------------------------------------------


@gluon.jit
def gl_globaltimer():
    """Nanoseconds from the GPU's global timer (`%globaltimer`)."""
    return gl.inline_asm_elementwise(ASM_GLOBALTIMER, "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def gl_exp2_ftz(x):
    """2^x (fp32) in one MUFU.EX2: flush-to-zero, so without the range check and the two rescales `gl.exp2` compiles
    to; a result below 2^-126 reads 0, which a softmax weight that small is anyway."""
    return gl.inline_asm_elementwise(ASM_EX2_FTZ, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def gl_bf16_to_f32(x):
    """x (bf16) as fp32, two elements per `ASM_BF16X2_TO_F32`: exact, as `x.to(gl.float32)`, in two instructions a
    pair."""
    bits = gl.inline_asm_elementwise(ASM_BF16X2_TO_F32, "=r,=r,r", [x], dtype=gl.int32, is_pure=True, pack=2)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def gl_smid():
    """The SM this thread runs on (`%smid`)."""
    return gl.inline_asm_elementwise(ASM_SMID, "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def gl_load_acquire_lead(ptr):
    """A counter poll by the first warp (acquire at GPU scope), the other threads reading INT32_MAX: it must be
    followed by a CTA barrier before any thread reads what the counter guards."""
    return gl.inline_asm_elementwise(ASM_LOAD_ACQUIRE_LEAD, "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gl_signal_release(ptr, add):
    """`*ptr += add` once per CTA (thread 0, which is in the compute partition), release at GPU scope; call after a
    CTA barrier."""
    return gl.inline_asm_elementwise(ASM_SIGNAL_RELEASE, "=r,l,r", [ptr, add], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gl_red_add_f16x2(ptrs, y, m):
    """`*ptrs += y` where m, for an fp16 destination, two adjacent elements a thread one 32-bit reduction: each
    thread's elements must come in pairs of consecutive addresses, the first 4-byte aligned (size_per_thread 2 along
    the contiguous dimension), and the layout must hold every element once."""
    return gl.inline_asm_elementwise(ASM_RED_ADD_F16X2, "=r,=r,l,l,f,f,r,r",
                                     [ptrs.to(gl.int64), gl.where(m, y, 0.0), m.to(gl.int32)], dtype=gl.int32,
                                     is_pure=False, pack=2)


_FUNC_START = re.compile(r"^(\.visible\s+|\.weak\s+)?\.func\b")
_ENTRY_START = re.compile(r"^(\.visible\s+|\.weak\s+)?\.entry\b")
_CTA_BARRIER = re.compile(r"\b(bar|barrier)\.sync(\.aligned)?\s+0\s*;")


def partition_barriers(ptx: str, threads: int) -> str:
    """`ptx` with every CTA-wide barrier (`bar.sync 0;`) inside a called function (`.func`) made the named barrier
    of `threads` threads (`bar.sync 0, threads;`). Triton knows which warp-specialize partition code runs in only
    where the code is inlined: in a function called from the compute partition it emits CTA barriers, which the loader
    warp never reaches. Used for the megakernel only, whose functions are all called from its compute partition."""
    out, in_func = [], False
    for line in ptx.splitlines(keepends=True):
        if _FUNC_START.match(line):
            in_func = True
        elif _ENTRY_START.match(line):
            in_func = False
        out.append(_CTA_BARRIER.sub(f"bar.sync 0, {threads};", line) if in_func else line)
    return "".join(out)
