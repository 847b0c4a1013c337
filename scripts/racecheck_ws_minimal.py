"""Minimal warp-specialized Gluon kernels for `compute-sanitizer --tool racecheck`, one per ingredient of interpreter
v10's partition structure, to find which one makes racecheck report the hazards it reports for v10 at Triton's
warp-specialization switch loop (docs/racecheck-warp-specialize.md):

- `plain`: a default partition and one worker partition that each write their own global output (no shared memory);
- `barrier`: as `plain`, and the default partition round-trips a tile through its own shared memory, with
  `gl.thread_barrier()` (a named barrier over the default partition's warps only) between store and load;
- `ring`: a shared-memory ring in v10's protocol without TMA: the worker fills a slot and arrives on its `ready`
  mbarrier, the default partition waits, reads, and hands the slot back on `empty`;
- `tma`: the same ring filled as v10 fills it, by TMA (`cp.async.bulk.tensor`) completing on `ready`;
- `named0` / `named2`: as `plain`, and the default partition executes `bar.sync 0, 256` (the barrier Triton gives the
  default partition: what `gl.thread_barrier()` becomes there) / `bar.sync 2, 256` (the same barrier under another
  id) between its stores, with no shared memory of its own.

    compute-sanitizer --tool racecheck python scripts/racecheck_ws_minimal.py --variant ring

Each run checks its own output and prints OK or WRONG, so a clean report comes from a run that computed the right
thing.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

N: gl.constexpr = gl.constexpr(256)  # elements per tile
NS: gl.constexpr = gl.constexpr(2)  # ring slots
STEPS: gl.constexpr = gl.constexpr(8)  # tiles through the ring / barrier round trips


@gluon.jit
def _plain_default(out_ptr, n, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, N, layout=lay)
    gl.store(out_ptr + gl.program_id(0) * N + offs, offs + n)


@gluon.jit
def _plain_worker(flag_ptr, n):
    gl.store(flag_ptr + gl.program_id(0), n)


@gluon.jit
def _barrier_default(out_ptr, buf, n, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, N, layout=lay)
    acc = gl.zeros([N], gl.int32, lay)
    for i in range(STEPS):
        buf.store(offs + n + i)
        gl.thread_barrier()
        acc += buf.load(lay)
        gl.thread_barrier()
    gl.store(out_ptr + gl.program_id(0) * N + offs, acc)


@gluon.jit
def _named_default(out_ptr, n, BAR: gl.constexpr, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, N, layout=lay)
    for _i in range(STEPS):  # one element per thread: one barrier per thread per step
        offs = gl.inline_asm_elementwise(f"bar.sync {BAR}, {32 * num_warps}; mov.b32 $0, $1;", "=r,r", [offs],
                                         dtype=gl.int32, is_pure=False, pack=1)
    gl.store(out_ptr + gl.program_id(0) * N + offs, offs + n)


@gluon.jit
def _consume(ring, ready, empty, acc, lay: gl.constexpr):
    """The default partition's side of the ring (v10's protocol): wait for each slot, add it to `acc`, hand it back."""
    for t in range(STEPS):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        acc += ring.index(s).load(lay)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s))
    return acc


@gluon.jit
def _ring_default(out_ptr, ring, ready, empty, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, N, layout=lay)
    acc = _consume(ring, ready, empty, gl.zeros([N], gl.int32, lay), lay)
    gl.store(out_ptr + gl.program_id(0) * N + offs, acc)


@gluon.jit
def _ring_worker(ring, ready, empty, n):
    lay: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])
    offs = gl.arange(0, N, layout=lay)
    for t in range(STEPS):
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
        ring.index(s).store(offs + n + t)
        gl.thread_barrier()
        mbarrier.arrive(ready.index(s))


@gluon.jit
def _tma_worker(desc, ring, ready, empty):
    for t in range(STEPS):
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(s), N * 4)
        tma.async_copy_global_to_shared(desc, [t, 0], ready.index(s), ring.index(s))


@gluon.jit
def _slot_barriers():
    """Each ring slot's `ready` (filled) and `empty` (consumed) mbarriers, initialised."""
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def plain_kernel(out_ptr, flag_ptr, n, num_warps: gl.constexpr):
    gl.warp_specialize([(_plain_default, (out_ptr, n, num_warps)), (_plain_worker, (flag_ptr, n))], [1], [32])


@gluon.jit
def named_kernel(out_ptr, flag_ptr, n, BAR: gl.constexpr, num_warps: gl.constexpr):
    gl.warp_specialize([(_named_default, (out_ptr, n, BAR, num_warps)), (_plain_worker, (flag_ptr, n))], [1], [32])


@gluon.jit
def barrier_kernel(out_ptr, flag_ptr, n, num_warps: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.int32, [N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    gl.warp_specialize([(_barrier_default, (out_ptr, buf, n, num_warps)), (_plain_worker, (flag_ptr, n))], [1],
                       [32])


@gluon.jit
def ring_kernel(out_ptr, flag_ptr, n, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.int32, [NS, N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = _slot_barriers()
    gl.warp_specialize([(_ring_default, (out_ptr, ring, ready, empty, num_warps)),
                        (_ring_worker, (ring, ready, empty, n))], [1], [32])


@gluon.jit
def tma_kernel(out_ptr, desc, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.int32, [NS, 1, N], desc.layout)
    ready, empty = _slot_barriers()
    gl.warp_specialize([(_tma_default, (out_ptr, ring, ready, empty, num_warps)),
                        (_tma_worker, (desc, ring, ready, empty))], [1], [32])


@gluon.jit
def _tma_default(out_ptr, ring, ready, empty, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    offs = gl.arange(0, N, layout=gl.SliceLayout(0, lay))
    acc = _consume(ring, ready, empty, gl.zeros([1, N], gl.int32, lay), lay)
    gl.store(out_ptr + gl.program_id(0) * N + gl.expand_dims(offs, 0), acc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=["plain", "barrier", "ring", "tma", "named0", "named2"], default="plain")
    args = ap.parse_args()
    progs = 4
    out = torch.zeros(progs * 256, dtype=torch.int32, device="cuda")
    flag = torch.zeros(progs, dtype=torch.int32, device="cuda")
    steps = int(STEPS.value)
    if args.variant == "tma":
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        src = (torch.arange(256, device="cuda", dtype=torch.int32) + 7).repeat(steps, 1)
        src += torch.arange(steps, device="cuda", dtype=torch.int32)[:, None]
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        desc = TensorDescriptor(src, list(src.shape), list(src.stride()), [1, 256], layout)
        tma_kernel[(progs,)](out, desc, num_warps=8)
    elif args.variant.startswith("named"):
        named_kernel[(progs,)](out, flag, 7, BAR=int(args.variant[-1]), num_warps=8)
    else:
        kernel = {"plain": plain_kernel, "barrier": barrier_kernel, "ring": ring_kernel}[args.variant]
        kernel[(progs,)](out, flag, 7, num_warps=8)
    torch.cuda.synchronize()
    base = torch.arange(256, device="cuda", dtype=torch.int32)
    # every variant but plain sums tiles t + 7 + [0, 256) over its steps
    want = base + 7 if args.variant in ("plain", "named0", "named2") else steps * (base + 7) + steps * (steps - 1) // 2
    ok = bool((out.view(progs, 256) == want).all()) and (args.variant in ("ring", "tma") or bool((flag == 7).all()))
    print(f"{args.variant}: {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
