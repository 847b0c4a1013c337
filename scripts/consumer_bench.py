"""Can warp-independent consumers drain a shared-memory ring faster than v10's lockstep compute warps? (perf notes)

Interpreter v10's eight compute warps read each ring slot together, and Triton puts a CTA barrier before every mbarrier
wait, so they move in lockstep twice per slot: ~47 KB/us per SM over a full ring (gate/up, `MEGASYNTH_V10_DIAG=3`).
This standalone kernel measures the alternative before anyone rebuilds the interpreter around it. One loader warp
"fills" slots by arriving on their mbarriers (no bytes move: the consumers' own rate), and the ring's [16, 256] bf16
box pairs are multiplied by a staged vector as gate/up does, in one of three ways:

- ``lockstep``: one 8-warp partition, every warp a part of every slot (v10's way);
- ``warps``: eight one-warp partitions, warp c taking slots c, c + 8, ... alone. A one-warp partition's compiler
  barrier spans one warp, and each warp hands its slot back itself (its lane 0 arrives on the slot's mbarrier);
- ``mma2`` / ``mma4``: the tensor cores read the slot (`StreamConfig.mma`'s way): 2 or 4 boxes as a [128 or 256, 64]
  wgmma operand (128 B swizzle) times a staged [64, 8] bf16 operand, one wgmma in flight (run 40: 114 / 147 KB/us).

Prints KB/us per SM for each; writes $OUT/consumer_bench.json.

    python scripts/consumer_bench.py [--slots-per-sm 4096] [--compile-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

NS: gl.constexpr = gl.constexpr(12)  # ring slots (2 boxes of [16, 256] bf16 each: 16 KB)
NC: gl.constexpr = gl.constexpr(8)  # consumer warps
BK: gl.constexpr = gl.constexpr(256)
RING_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _loader(ready, empty, n):
    """Fake fills in order: slot t % NS once its previous use was handed back."""
    for t in range(n):
        s = t % NS
        if t >= NS:
            mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
        mbarrier.arrive(ready.index(s))


@gluon.jit
def _lockstep(ring, ready, empty, vbuf, out_ptr, n, num_warps: gl.constexpr):
    """v10's consumer: all warps read each slot, a CTA barrier, one arrive."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    acc = gl.zeros([16, BK], gl.float32, blk)
    for t in range(n):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        v = gl.expand_dims(vbuf.index(t % 8).load(gl.SliceLayout(0, blk)), 0)
        acc += ring.index(2 * s).load(blk).to(gl.float32) * v
        acc += ring.index(2 * s + 1).load(blk).to(gl.float32) * v
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, blk))
    gl.store(out_ptr + gl.program_id(0) * 16 + rows, gl.sum(acc, axis=1))


MMA_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def _mma(ring, ready, empty, xs, out_ptr, n, BOXES: gl.constexpr, num_warps: gl.constexpr):
    """Tensor cores read the slot: its boxes viewed [BOXES * 64, 64] (rows r, 64-column chunks j as row 4r + j, 128 B
    swizzle) times a staged [64, 8] bf16 operand (hi and lo halves of four activation chunks), async, one in flight."""
    NSL: gl.constexpr = NS * 2 // BOXES
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 8, 16])
    acc = gl.zeros([BOXES * 64, 8], gl.float32, acc_l)
    for t in range(n):
        s = t % NSL
        mbarrier.wait(ready.index(s), (t // NSL) & 1)
        acc = warpgroup_mma(ring.index(s), xs.index(t % 8).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((t + NSL - 1) % NSL), pred=t > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    gl.thread_barrier()
    mbarrier.arrive(empty.index((n + NSL - 1) % NSL))
    rows = gl.arange(0, BOXES * 64, layout=gl.SliceLayout(1, acc_l))
    gl.store(out_ptr + gl.program_id(0) * BOXES * 64 + rows, gl.sum(acc, axis=1))


@gluon.jit
def mma_kernel(out_ptr, n, BOXES: gl.constexpr, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS * 2 // BOXES, BOXES * 64, 64], MMA_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.bfloat16, [8, 8, 64], MMA_LAYOUT)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    for i in gl.static_range(8):
        xs.index(i).store(gl.full([8, 64], 0.5, gl.bfloat16, lay))
    for i in gl.static_range(NS * 2 // BOXES):
        ring.index(i).store(gl.full([BOXES * 64, 64], 1.0, gl.bfloat16, lay))
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.thread_barrier()
    gl.warp_specialize([
        (_mma, (ring, ready, empty, xs, out_ptr, n, BOXES, num_warps)),
        (_loader_ns, (ready, empty, n, NS * 2 // BOXES)),
    ], [1], [24])


@gluon.jit
def _loader_ns(ready, empty, n, NSL: gl.constexpr):
    """As `_loader`, over NSL slots."""
    for t in range(n):
        s = t % NSL
        if t >= NSL:
            mbarrier.wait(empty.index(s), ((t // NSL) & 1) ^ 1)
        mbarrier.arrive(ready.index(s))


@gluon.jit
def _idle(out_ptr, num_warps: gl.constexpr):
    pass


@gluon.jit
def _one_warp(ring, ready, empty, vbuf, out_ptr, n, c: gl.constexpr):
    """Warp c alone on slots c, c + NC, ...: per lane, partial sums of 16 rows over its 8 columns (no shuffles until
    the end)."""
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [1, 1, 1], [2, 1, 0])
    flat3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    acc = gl.zeros([16, 32], gl.float32, gl.SliceLayout(2, l3))
    for t in range(c, n, NC):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        v = gl.expand_dims(vbuf.index(t % 8)._reinterpret(gl.float32, [32, 8], flat2).load(gl.SliceLayout(0, l3)), 0)
        a = ring.index(2 * s)._reinterpret(gl.bfloat16, [16, 32, 8], flat3).load(l3)
        b = ring.index(2 * s + 1)._reinterpret(gl.bfloat16, [16, 32, 8], flat3).load(l3)
        acc += gl.sum(a.to(gl.float32) * v, axis=2) + gl.sum(b.to(gl.float32) * v, axis=2)
        mbarrier.arrive(empty.index(s))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    gl.store(out_ptr + (gl.program_id(0) * NC + c) * 16 + rows, gl.sum(acc, axis=1))


@gluon.jit
def consume_kernel(out_ptr, n, WARPS: gl.constexpr, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, 16, BK], RING_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    vstage = gl.allocate_shared_memory(gl.float32, [8, BK],
                                       gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    vbuf = vstage._reinterpret(gl.float32, [8, BK], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    vstage.store(gl.full([8, BK], 0.5, gl.float32, lay))
    ring.index(0).store(gl.full([16, BK], 1.0, gl.bfloat16, lay))
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.thread_barrier()
    if WARPS:
        gl.warp_specialize([
            (_idle, (out_ptr, num_warps)),
            (_loader, (ready, empty, n)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 0)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 1)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 2)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 3)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 4)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 5)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 6)),
            (_one_warp, (ring, ready, empty, vbuf, out_ptr, n, 7)),
        ], [1] * 9, [24] + [128] * 8)
    else:
        gl.warp_specialize([
            (_lockstep, (ring, ready, empty, vbuf, out_ptr, n, num_warps)),
            (_loader, (ready, empty, n)),
        ], [1], [24])


def _time(fn, reps: int = 10) -> tuple[float, list[float]]:
    for _ in range(2):  # compile + warm up
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    return sorted(times)[len(times) // 2], times


def compile_only() -> int:
    """Compile every variant for sm_90 without a GPU (registers, spills, shared memory)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from megasynth.kernels.gpu.offline import _compile

    for name, fn, consts in (("lockstep", consume_kernel, {"WARPS": False}), ("mma2", mma_kernel, {"BOXES": 2}),
                             ("mma4", mma_kernel, {"BOXES": 4})):
        _, res = _compile(fn, GluonASTSource, {**consts, "num_warps": 8}, {"out_ptr": "*fp32", "n": "i32"}, 8, {})
        print(f"{name:9s} {res}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots-per-sm", type=int, default=4096)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU and print resources")
    ap.add_argument("--out", default=os.environ.get("OUT", "consumer_bench_out"))
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(sms * 8 * 64, dtype=torch.float32, device="cuda")
    n = args.slots_per_sm
    variants = [
        ("lockstep", 16384, lambda: consume_kernel[(sms,)](out, n, WARPS=False, num_warps=8)),
        ("warps", 16384, lambda: consume_kernel[(sms,)](out, n, WARPS=True, num_warps=4)),
        ("mma2", 16384, lambda: mma_kernel[(sms,)](out, n, BOXES=2, num_warps=8)),
        ("mma4", 32768, lambda: mma_kernel[(sms,)](out, n // 2, BOXES=4, num_warps=8)),
    ]
    rows = []
    for name, slot_bytes, fn in variants:
        ms, times = _time(fn)
        slots = n if slot_bytes == 16384 else n // 2
        rate = slots * slot_bytes / 1024 / (ms * 1e3)  # KB per us per SM
        rows.append({"consumer": name, "median_ms": ms, "kb_per_us_per_sm": rate, "times_ms": times})
        print(f"{name:9s} {ms:8.3f} ms for {slots} slots of {slot_bytes // 1024} KB per SM: {rate:6.1f} KB/us per SM",
              flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "consumer_bench.json").write_text(json.dumps({"sms": sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
