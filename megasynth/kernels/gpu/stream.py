"""Interpreter v10: a warp-specialized persistent megakernel whose weight stream never stops (Gluon, sm_90).

Each program (one per SM) runs two partitions over the same queue of packed instruction rows (kernels/gpu/pack.py):

- the *loader* (one warp) walks the queue ahead of the compute warps and streams every weight tile the queue will
  need into a ring of shared-memory slots with TMA (`cp.async.bulk.tensor`), each slot completing on its own
  mbarrier. Weights are never written during a step, so the loader never waits on a counter: it runs ahead across
  instruction boundaries and while the compute warps spin, bounded by the ring's size and by `INFLIGHT` slots in
  flight (so the compute warps' own loads do not queue behind the whole ring). Attention's K/V history (positions
  before pos, never written during a step) is streamed the same way (`KV_RING`);
- the *compute* partition (the default, `num_warps` warps) waits on the instruction's counters (acquire loads by its
  first warp while the others wait at a CTA barrier; the `%globaltimer` watchdog), stages the
  activation vector it needs into shared memory in one load, consumes the ring's slots in the loader's order (wait
  `ready[s]`, read, release `empty[s]`), runs the op's epilogue, and signals (CTA barrier, then a release add from
  one thread). The split reduction and the embedding read no weights.

A slot holds SB (2 or 4) [16, BK] boxes, paired by row so that both boxes of a pair multiply the same activation
chunk: gate with up, a RoPE pair's first half with its second half, and rows r and r + 16 of o_proj, down and the LM
head. Attention takes a K block and a V block. Both partitions walk the same rows with the same loop structure and
helpers (`_qkv_group`, `_load_k`'s order), so they agree on the slot sequence by construction.

With `StreamConfig.mma` the compute warps multiply on the tensor cores instead: each box is a wgmma operand read where
TMA put it and the staged vector a bf16 hi/lo operand (`_pair_rows_mma`); measured not faster in the whole step, so
off by default (docs/perf-notes.md).

A batch (`NB` sequences, a compile-time constant) always multiplies on the tensor cores, one wgmma per slot for every
sequence (`_batch_op`). Below `StreamConfig.batch_tiles` sequences its slots are the row-pair boxes above; from there
a slot is a [128, 64] tile of 128 weight rows (`_issue_tile`), so that every column of the product is used. A slot's
ready/empty waits are not bounded by the watchdog: the two partitions agree on the slot sequence by construction,
and a slot whose armed bytes never arrive would hang the kernel; the host bounds its own wait for the step instead
(`timing.wait_for_gpu`: a `GpuHangError` after a minute, where it would otherwise block forever).

The PTX of the counter protocol and the clocks is kernels/gpu/ptx.py's, shared with interpreter v9.

After a watchdog timeout a worker records the stuck wait and stops waiting (it still computes and signals, on
whatever data is there), and raises a global abort flag that ends every other worker's waits too: the ring always
drains, so the kernel always ends. The host then raises `WatchdogError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megasynth.ir.model import ModelConfig
from megasynth.kernels.gpu import ptx
from megasynth.kernels.gpu.pack import (
    F_A4,
    F_IDX,
    K_VEC,
    OPCODES,
    ROW,
    TRACE_FIELDS,
    V10_TILE_BATCH,
    batch_model_limits,
    v10_qkv_box_rows,
    v10_tile_slots,
)

OP_EMBED: gl.constexpr = gl.constexpr(OPCODES["embed"])
OP_QKV: gl.constexpr = gl.constexpr(OPCODES["attn_norm_qkv_rope"])
OP_QKV_SQ: gl.constexpr = gl.constexpr(OPCODES["attn_norm_qkv_rope_sq"])
OP_QK_APPLY: gl.constexpr = gl.constexpr(OPCODES["qk_norm_apply"])
OP_PARTIAL: gl.constexpr = gl.constexpr(OPCODES["attn_partial"])
OP_REDUCE: gl.constexpr = gl.constexpr(OPCODES["attn_reduce"])
OP_OPROJ: gl.constexpr = gl.constexpr(OPCODES["o_proj_residual"])
OP_FUSED: gl.constexpr = gl.constexpr(OPCODES["attn_reduce_o_proj"])
FA4: gl.constexpr = gl.constexpr(F_A4)  # the row field of an op's fifth argument
FIDX: gl.constexpr = gl.constexpr(F_IDX)  # the row field of the instruction's trace row (`_row17`'s idx)
TRACE_W: gl.constexpr = gl.constexpr(TRACE_FIELDS)  # int64 fields per trace row (megasynth/kernels/gpu/pack.py)
OP_GATE_UP: gl.constexpr = gl.constexpr(OPCODES["mlp_norm_gate_up"])
OP_DOWN: gl.constexpr = gl.constexpr(OPCODES["down_proj_residual"])
OP_LM_HEAD: gl.constexpr = gl.constexpr(OPCODES["final_norm_lm_head"])
BR: gl.constexpr = gl.constexpr(16)  # rows per TMA box
GR: gl.constexpr = gl.constexpr(64)  # a batch's ring slot: a [2 GR, 64] wgmma tile of two GR-row halves
#: q values qk_norm_apply loads at once (`_op_qk_apply`): 8 fp32 registers a thread of the 8 compute warps
QK_APPLY_VALUES: gl.constexpr = gl.constexpr(2048)
SUB: gl.constexpr = gl.constexpr(64)  # K elements per TMA box on the tensor-core path: 128 B rows, 128 B swizzle
#: Ring tiles and the staged operand on the tensor-core path (`StreamConfig.mma`): what wgmma reads from shared memory
MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
#: The same bytes as the TMA destination of one weight box: [16 rows, BK / 64 sub-chunks, 64] (row 4 r + q of a tile)
MMA_BOX: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
#: `KV_RING` == KV_MMA: attention reads the ring's K/V blocks on the tensor cores (`_attn_ring_mma`), and TMA writes
#: them with a 128 B swizzle (`kv_box_layout`), so that the operand loads (ldmatrix) meet no bank conflicts
KV_MMA: gl.constexpr = gl.constexpr(2)
#: `KV_RING` == KV_ROWS: a batch's attention on the tensor cores with the positions as the product's rows
#: (`_attn_ring_rows`): BTK = 16 positions per compute warp, K and V in [BTK, 64] blocks (`_issue_kv_rows`)
KV_ROWS: gl.constexpr = gl.constexpr(3)
ABORT: gl.constexpr = gl.constexpr(7)  # err_ptr[ABORT] (worker 0's spare field): set once any worker timed out
#: A waiting worker reads the global abort flag only once it has waited this long (ns): every waiting worker's poll
#: loop reading one more word each round is the kind of L2 hot spot the first-warp poll removes for the counters,
#: and an abort only follows a watchdog timeout (0.1 s and up).
ABORT_AFTER_NS: gl.constexpr = gl.constexpr(20000)


# -- watchdog -----------------------------------------------------------------------------------------------------


@gluon.jit
def _report_stuck(err_ptr, pid, iid, counter, cur, need):
    e = err_ptr + pid * 8
    gl.store(e + 1, pid)
    gl.store(e + 2, iid)
    gl.store(e + 3, counter)
    gl.store(e + 4, cur)
    gl.store(e + 5, need)
    gl.store(e + 6, ptx.gl_smid())
    gl.store(e, 1)
    gl.atomic_xchg(err_ptr + ABORT, 1, sem="relaxed", scope="gpu")


# -- the slot sequence (shared by both partitions) ----------------------------------------------------------------


@gluon.jit
def _qkv_group(p, pend, HALF: gl.constexpr, GR: gl.constexpr):
    """The next RoPE-pair group of a QKV tile: pairs [p, p + n) of one head, n <= GR (rows are in pair order; GR is
    16 at batch 1, a batch tile's 64 rows per half in a batch)."""
    head = p // HALF
    j = p - head * HALF
    n = gl.minimum(gl.minimum(HALF - j, pend - p), GR)
    return head, j, n


# -- loader partition ------------------------------------------------------------------------------------------


@gluon.jit
def _expect(bar, nboxes, SB: gl.constexpr, BOX_BYTES: gl.constexpr):
    """Arm `bar` for nboxes boxes (1..SB): expect-tx takes a constant byte count, so one predicated arm per count."""
    for m in gl.static_range(1, SB + 1):
        mbarrier.expect(bar, m * BOX_BYTES, pred=nboxes == m)


@gluon.jit
def _claim(t, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr):
    """Wait until slot t % NS may be filled: the compute warps released it, and (INFLIGHT < NS) at most INFLIGHT
    earlier fills are still in flight, so that the compute warps' own loads (counters, activations) do not queue
    behind the whole ring (`StreamConfig.inflight`; measurements in docs/perf-notes.md)."""
    s = t % NS
    if INFLIGHT < NS:
        if t >= INFLIGHT:
            u = t - INFLIGHT
            mbarrier.wait(ready.index(u % NS), (u // NS) & 1)
    mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)
    return s


@gluon.jit
def _copy_box(d, r, c, bar, ring, box, ok, NBOX: gl.constexpr, BK: gl.constexpr, MMA: gl.constexpr):
    """Ring box `box` (of NBOX) <- rows [r, r + 16) of d over K [c, c + BK): one [16, BK] copy; on the tensor-core
    path d is viewed [rows, K / 64, 64] and the box [16, BK / 64, 64] lands (128 B swizzle) as a [16 * BK / 64, 64]
    wgmma tile whose row 4 r + q is row r's q-th 64-column sub-chunk. Sub-chunks past K are zero-filled (and counted
    by the mbarrier's transaction bytes, like the rest)."""
    if MMA:
        boxes = ring._reinterpret(gl.bfloat16, [NBOX, BR, BK // SUB, SUB], MMA_BOX)
        tma.async_copy_global_to_shared(d, [r, c // SUB, 0], bar, boxes.index(box), pred=ok)
    else:
        tma.async_copy_global_to_shared(d, [r, c], bar, ring.index(box), pred=ok)


@gluon.jit
def _cp_box(ptr, nrows, K: gl.constexpr, r, c, dst, ok, ROWS: gl.constexpr, COLS: gl.constexpr):
    """`dst` ([ROWS, COLS] bf16, unswizzled) <- rows [r, r + ROWS) of the row-major [nrows, K] matrix at ptr over
    columns [c, c + COLS), by the loader warp's cp.async, 16 bytes a copy (`StreamConfig.cp_fill`); nothing when
    not ok. A box inside the matrix (every box of the models served) is copied from one base pointer and
    offsets the compiler knows; one that crosses its end has the rows and columns past it zero-filled, as TMA fills
    past a descriptor's bounds. Completion is the caller's `async_copy.mbarrier_arrive` on the slot's barrier."""
    TC: gl.constexpr = min(32, COLS // 8)
    RG: gl.constexpr = 32 // TC * 4  # rows a copy: 4 of 16 bytes a thread (the loader warp has few registers)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [1, 1], [1, 0])
    lr = gl.arange(0, RG, layout=gl.SliceLayout(1, lay))
    lc = gl.arange(0, COLS, layout=gl.SliceLayout(0, lay))
    off = gl.expand_dims(lr * K, 1) + gl.expand_dims(lc, 0)
    c8 = c // 8 * 8  # c is a multiple of 8 (`pack.check_k_ranges`): this tells the compiler, for 16-byte copies
    base = ptr + (r.to(gl.int64) * K + c8)
    if ok:
        if (r + ROWS <= nrows) & (c8 + COLS <= K):
            for g in gl.static_range(ROWS // RG):
                async_copy.async_copy_global_to_shared(dst.slice(g * RG, RG, dim=0), base + g * RG * K + off)
        else:
            cmask = gl.expand_dims(c8 + lc < K, 0)
            for g in gl.static_range(ROWS // RG):
                rmask = gl.expand_dims(r + g * RG + lr < nrows, 1)
                async_copy.async_copy_global_to_shared(dst.slice(g * RG, RG, dim=0), base + g * RG * K + off,
                                                       mask=gl.max_constancy(rmask & cmask, [1, 8]))


@gluon.jit
def _issue_pair(da, db, ra, rb, okb, c0, kb, nkb, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr,
                SB: gl.constexpr, BK: gl.constexpr, BOX_BYTES: gl.constexpr, MMA: gl.constexpr, pa, pb,
                NRA: gl.constexpr, NRB: gl.constexpr, KD: gl.constexpr, CPF: gl.constexpr):
    """Slot t % NS <- rows ra (of da) and, when okb, rb (of db) over K chunks kb .. kb + SB/2 - 1 (those below nkb)
    from column c0. With CPF the loader warp copies them by cp.async from the matrices at pa and pb ([NRA, KD] and
    [NRB, KD]) and arrives on the slot's ready barrier when its copies land."""
    s = _claim(t, ready, empty, NS, INFLIGHT)
    bar = ready.index(s)
    if CPF:
        for j in gl.static_range(SB // 2):
            ok = kb + j < nkb
            c = c0 + (kb + j) * BK
            _cp_box(pa, NRA, KD, ra, c, ring.index(SB * s + 2 * j), ok, BR, BK)
            _cp_box(pb, NRB, KD, rb, c, ring.index(SB * s + 2 * j + 1), ok & okb, BR, BK)
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        _expect(bar, (1 + okb.to(gl.int32)) * gl.minimum(nkb - kb, SB // 2), SB, BOX_BYTES)
        for j in gl.static_range(SB // 2):
            ok = kb + j < nkb
            c = c0 + (kb + j) * BK
            _copy_box(da, ra, c, bar, ring, SB * s + 2 * j, ok, SB * NS, BK, MMA)
            _copy_box(db, rb, c, bar, ring, SB * s + 2 * j + 1, ok & okb, SB * NS, BK, MMA)
    return t + 1


@gluon.jit
def _issue_kv(dk, dv, row, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr, SB: gl.constexpr,
              BTK: gl.constexpr, HD: gl.constexpr, KV_RING: gl.constexpr, kc_ptr, vc_ptr, NKR: gl.constexpr,
              CPF: gl.constexpr):
    """Slot t % NS <- K and V rows [row, row + BTK) of the cache: the slot's first two [BTK, HD] blocks
    (`_kv_blocks`); with CPF by cp.async from the caches at kc_ptr and vc_ptr (NKR rows each), as `_issue_pair`."""
    kv = _kv_blocks(ring, BTK, HD, KV_RING)
    KPS: gl.constexpr = SB * ring.shape[1] * ring.shape[2] // (BTK * HD)  # [BTK, HD] blocks per slot
    s = _claim(t, ready, empty, NS, INFLIGHT)
    bar = ready.index(s)
    if CPF:
        _cp_box(kc_ptr, NKR, HD, row, row * 0, kv.index(KPS * s), True, BTK, HD)
        _cp_box(vc_ptr, NKR, HD, row, row * 0, kv.index(KPS * s + 1), True, BTK, HD)
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.expect(bar, 2 * BTK * HD * 2)
        tma.async_copy_global_to_shared(dk, [row, 0], bar, kv.index(KPS * s))
        tma.async_copy_global_to_shared(dv, [row, 0], bar, kv.index(KPS * s + 1))
    return t + 1


@gluon.jit
def _issue_kv_rows(dk, dv, row, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr, SB: gl.constexpr,
                   BTK: gl.constexpr, HD: gl.constexpr):
    """`_attn_ring_rows`' K and V rows [row, row + BTK): HD / 64 [BTK, 64] chunks of K, then of V, in consecutive
    [BTK, 64] blocks of the ring (`_kv_blocks`), one slot or two (a 128-dim head's 128 positions fill a 32 KB slot
    with K alone, V takes the next)."""
    kv = _kv_blocks(ring, BTK, 64, KV_ROWS)
    DH: gl.constexpr = HD // 64
    KPS: gl.constexpr = SB * ring.shape[1] * ring.shape[2] // (BTK * 64)  # blocks per slot
    for j in gl.static_range(2 * DH // KPS):
        s = _claim(t, ready, empty, NS, INFLIGHT)
        bar = ready.index(s)
        mbarrier.expect(bar, KPS * BTK * 64 * 2)
        for i in gl.static_range(KPS):  # block j KPS + i of the pair: K's chunks, then V's
            if j * KPS + i < DH:
                tma.async_copy_global_to_shared(dk, [row, (j * KPS + i) * 64], bar, kv.index(KPS * s + i))
            else:
                tma.async_copy_global_to_shared(dv, [row, (j * KPS + i - DH) * 64], bar, kv.index(KPS * s + i))
        t = t + 1
    return t


@gluon.jit
def _kv_blocks(ring, BTK: gl.constexpr, HD: gl.constexpr, KV_RING: gl.constexpr):
    """The ring as [BTK, HD] bf16 K/V blocks, 128 B swizzled where the tensor cores read them (`kv_box_layout`): a
    slot's K block is its first, its V block the next."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if KV_RING >= KV_MMA else 0,
                                                element_bitwidth=16, rank=2)
    N: gl.constexpr = ring.shape[0] * ring.shape[1] * ring.shape[2] // (BTK * HD)
    return ring._reinterpret(gl.bfloat16, [N, BTK, HD], layout)


@gluon.jit
def _load_k(desc, base, a0, a1, k0, k1, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr,
            SB: gl.constexpr, BK: gl.constexpr, BOX_BYTES: gl.constexpr, MMA: gl.constexpr, KW: gl.constexpr,
            TILE: gl.constexpr, XR: gl.constexpr, KT: gl.constexpr, wp, NR: gl.constexpr, KD: gl.constexpr,
            CPF: gl.constexpr):
    """The slots of W[a0:a1, k0:k1] (rows from base): rows r and r + 16 over the same K chunks (the second box only
    while r + 16 < a1), so that both boxes of a slot multiply one activation chunk, as gate/up's do. With KW > 0
    (a batch; at batch 1 `StreamConfig.down_window`) K goes in windows of at most KW, all rows per window (the
    consumer stages each window once: `_op_kpaired_batch`, `_op_kpaired`); on the tensor cores from k0 rounded down
    to 64 columns (a box starts at a multiple of 64; the staged operand is zero below k0); with TILE, in
    `_issue_tile`'s [128, 64] tiles, 128 rows at a time. wp, NR, KD: the matrix for CPF (`_issue_pair`)."""
    if KW > 0:
        for w0 in range(k0 // SUB * SUB if MMA else k0, k1, KW):
            w1 = gl.minimum(w0 + KW, k1)
            if TILE:
                for r in range(a0, a1, 2 * GR):
                    t = _load_tile_rows(desc, desc, base + r, base + r + GR, gl.minimum(a1 - r, GR),
                                        gl.minimum(a1 - r - GR, GR), w0, w1, t, ring, ready, empty, NS, INFLIGHT,
                                        XR, KT)
            else:
                t = _load_rows(desc, base, a0, a1, w0, w1, t, ring, ready, empty, NS, INFLIGHT, SB, BK, BOX_BYTES,
                               MMA, wp, NR, KD, CPF)
    else:
        t = _load_rows(desc, base, a0, a1, k0, k1, t, ring, ready, empty, NS, INFLIGHT, SB, BK, BOX_BYTES, MMA, wp,
                       NR, KD, CPF)
    return t


@gluon.jit
def _load_rows(desc, base, a0, a1, k0, k1, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr,
               SB: gl.constexpr, BK: gl.constexpr, BOX_BYTES: gl.constexpr, MMA: gl.constexpr, wp, NR: gl.constexpr,
               KD: gl.constexpr, CPF: gl.constexpr):
    """`_load_k`'s row-pair slots of one K range: rows r and r + 16 over the same K chunks, 32 rows at a time."""
    nkb = (k1 - k0 + BK - 1) // BK
    for r in range(a0, a1, 2 * BR):
        for kb in range(0, nkb, SB // 2):
            t = _issue_pair(desc, desc, base + r, base + r + BR, r + BR < a1, k0, kb, nkb, t, ring, ready, empty,
                            NS, INFLIGHT, SB, BK, BOX_BYTES, MMA, wp, wp, NR, NR, KD, CPF)
    return t


@gluon.jit
def _issue_tile(da, db, ra, rb, na, nb, c, t, ring, ready, empty, NS: gl.constexpr, INFLIGHT: gl.constexpr,
                XR: gl.constexpr, KT: gl.constexpr, KP: gl.constexpr = 1):
    """A batch's slot t % NS <- KT [2 GR, 64] wgmma tiles over K [c, c + 64 KT), one per 64 columns: rows
    [ra, ra + na) of da are a tile's first GR rows, rows [rb, rb + nb) of db its last GR, in [XR, 64] boxes (the
    descriptors' box rows). na, nb <= GR: the armed bytes count the copies issued (nb <= 0 copies nothing into the
    second half); an XR-row group past na or nb is not copied, its rows of the product never used. Every column of
    a tile meets every sequence's column of the staged operand (`_pair_rows_batch`). With KP = GR / XR > 1 (a
    64-dim head's QKV tiles, `StreamConfig.qkv_kpack`) a half's KP boxes hold the same XR rows at KP consecutive
    64-column sub-chunks, so a tile spans 64 KP columns and no row of the product is wasted (`_pair_rows_batch`)."""
    s = _claim(t, ready, empty, NS, INFLIGHT)
    bar = ready.index(s)
    NG: gl.constexpr = GR // XR  # boxes per half
    if KP > 1:
        _expect(bar, KT * NG * ((na > 0).to(gl.int32) + (nb > 0).to(gl.int32)), 2 * NG * KT, XR * SUB * 2)
    else:
        _expect(bar, KT * ((gl.maximum(na, 0) + XR - 1) // XR + (gl.maximum(nb, 0) + XR - 1) // XR), 2 * NG * KT,
                XR * SUB * 2)
    groups = ring._reinterpret(gl.bfloat16, [NS * KT * 2 * NG, XR, SUB], MMA_SMEM)  # a tile: 2 halves of [GR, 64]
    for q in gl.static_range(KT):  # past K the copies are zero-filled; the staged operand is zero past a window
        for g in gl.static_range(NG):
            tile = (KT * s + q) * 2 * NG
            if KP > 1:
                tma.async_copy_global_to_shared(da, [ra, c + (q * KP + g) * SUB], bar, groups.index(tile + g),
                                                pred=na > 0)
                tma.async_copy_global_to_shared(db, [rb, c + (q * KP + g) * SUB], bar, groups.index(tile + NG + g),
                                                pred=nb > 0)
            else:
                tma.async_copy_global_to_shared(da, [ra + g * XR, c + q * SUB], bar, groups.index(tile + g),
                                                pred=g * XR < na)
                tma.async_copy_global_to_shared(db, [rb + g * XR, c + q * SUB], bar, groups.index(tile + NG + g),
                                                pred=g * XR < nb)
    return t + 1


@gluon.jit
def _load_tile_rows(da, db, ra, rb, na, nb, k0, k1, t, ring, ready, empty, NS: gl.constexpr,
                    INFLIGHT: gl.constexpr, XR: gl.constexpr, KT: gl.constexpr, KP: gl.constexpr = 1):
    """`_issue_tile`'s slots of one row group over K [k0, k1), 64 KT KP columns per slot."""
    for c in range(k0, k1, SUB * KT * KP):
        t = _issue_tile(da, db, ra, rb, na, nb, c, t, ring, ready, empty, NS, INFLIGHT, XR, KT, KP)
    return t


@gluon.jit
def _row6(ins_ptr, q, ROWW: gl.constexpr):
    row = ins_ptr + q * ROWW
    return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4),
            gl.load(row + 5))


@gluon.jit
def _row17(ins_ptr, q, ROWW: gl.constexpr):
    """The fields of queue row q (kernels/gpu/pack.py's layout) the compute partition reads: the first 16 and the
    fifth argument (callers clamp q into the worker's queue, or to row 0 for an empty queue, whose fields are then
    never used)."""
    row = ins_ptr + q * ROWW
    return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4), gl.load(row + 5),
            gl.load(row + 6), gl.load(row + 7), gl.load(row + 8), gl.load(row + 9), gl.load(row + 10),
            gl.load(row + 11), gl.load(row + 12), gl.load(row + 13), gl.load(row + 14), gl.load(row + 15),
            gl.load(row + FA4))


@gluon.jit
def _loader(ins_ptr, qoff_ptr, rt_ptr, trace_ptr, d_qkv, d_o, d_g, d_u, d_d, d_lm, d_k, d_v, wqkv_ptr, wo_ptr, wg_ptr,
            wu_ptr, wd_ptr, lm_head_ptr, kc_ptr, vc_ptr, ring, ready, empty, H: gl.constexpr, IS: gl.constexpr,
            NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr,
            QK_NORM: gl.constexpr, ROWW: gl.constexpr, NS: gl.constexpr, INFLIGHT: gl.constexpr, QIN: gl.constexpr,
            SB: gl.constexpr, BK: gl.constexpr, BTK: gl.constexpr, KV_RING: gl.constexpr, MMA: gl.constexpr,
            TRACE: gl.constexpr, NB: gl.constexpr, KW: gl.constexpr, TILE: gl.constexpr, XR: gl.constexpr,
            QXR: gl.constexpr, KT: gl.constexpr, NL: gl.constexpr, V: gl.constexpr, CPF: gl.constexpr,
            QKP: gl.constexpr, GIN: gl.constexpr):
    """Walk this worker's queue and stream each instruction's weight tiles into the ring, never waiting on counters.
    The next row is read one instruction ahead, so its latency hides behind the current instruction's issue. With
    TRACE, each instruction's trace row also gets when the loader reached it (every earlier fill issued) and when
    its own last fill was issued: how far the ring ran ahead of the compute warps. QKV with the QK-norm apart
    (QK_NORM builds only) streams the same tiles as QKV; qk_norm_apply reads no weights. In a batch (NB > 1) an
    attention instruction streams sequence a3's history: its position rt[NB + a3], its cache slot. With CPF the
    fills are the loader warp's cp.async from the weights' and caches' pointers (`StreamConfig.cp_fill`)."""
    BOX_BYTES: gl.constexpr = BR * BK * 2
    HALF: gl.constexpr = HD // 2
    QKV: gl.constexpr = NH * HD + 2 * NKV * HD
    NKH: gl.constexpr = (H + BK - 1) // BK
    pid = gl.program_id(0)
    qi = gl.load(qoff_ptr + pid)
    q1 = gl.load(qoff_ptr + pid + 1)
    t = qi * 0
    pos = gl.load(rt_ptr + 1)
    op, layer, a0, a1, a2, a3 = _row6(ins_ptr, gl.maximum(gl.minimum(qi, q1 - 1), 0), ROWW)
    while qi < q1:
        n_op, n_layer, n_a0, n_a1, n_a2, n_a3 = _row6(ins_ptr, gl.maximum(gl.minimum(qi + 1, q1 - 1), 0), ROWW)
        if TRACE:
            t_reach = ptx.gl_globaltimer()
        is_qkv = op == OP_QKV
        if QK_NORM:
            is_qkv = is_qkv | (op == OP_QKV_SQ)
        if is_qkv:
            base = layer * QKV
            p = a0 // 2
            pend = a1 // 2
            while p < pend:
                head, j, n = _qkv_group(p, pend, HALF, GR // QKP if TILE else BR)
                ra = base + head * HD + j
                if TILE:
                    t = _load_tile_rows(d_qkv, d_qkv, ra, ra + HALF, n, n, 0, H, t, ring, ready, empty, NS, QIN,
                                        QXR, KT, QKP)
                else:
                    for kb in range(0, NKH, SB // 2):
                        t = _issue_pair(d_qkv, d_qkv, ra, ra + HALF, p < pend, 0, kb, NKH, t, ring, ready, empty, NS,
                                        INFLIGHT, SB, BK, BOX_BYTES, MMA, wqkv_ptr, wqkv_ptr, NL * QKV, NL * QKV, H,
                                        CPF)
                p += n
        elif op == OP_GATE_UP:
            base = layer * IS
            if TILE:
                for r in range(a0, a1, GR):
                    n = gl.minimum(a1 - r, GR)
                    t = _load_tile_rows(d_g, d_u, base + r, base + r, n, n, 0, H, t, ring, ready, empty, NS, GIN,
                                        XR, KT)
            else:
                for r in range(a0, a1, BR):
                    for kb in range(0, NKH, SB // 2):
                        t = _issue_pair(d_g, d_u, base + r, base + r, r < a1, 0, kb, NKH, t, ring, ready, empty, NS,
                                        INFLIGHT, SB, BK, BOX_BYTES, MMA, wg_ptr, wu_ptr, NL * IS, NL * IS, H, CPF)
        elif (op == OP_OPROJ) | (op == OP_FUSED):
            t = _load_k(d_o, layer * H, a0, a1, a2, a3, t, ring, ready, empty, NS, INFLIGHT, SB, BK, BOX_BYTES, MMA,
                        KW, TILE, XR, KT, wo_ptr, NL * H, NH * HD, CPF)
        elif op == OP_DOWN:
            t = _load_k(d_d, layer * H, a0, a1, a2, a3, t, ring, ready, empty, NS, INFLIGHT, SB, BK, BOX_BYTES, MMA,
                        KW, TILE, XR, KT, wd_ptr, NL * H, IS, CPF)
        elif op == OP_PARTIAL:
            if KV_RING:  # the split's K/V history: positions < pos are never written during a step
                if NB > 1:
                    pos = gl.load(rt_ptr + NB + a3)
                    row0 = ((layer * NB + a3) * NKV + a0) * S
                else:
                    row0 = (layer * NKV + a0) * S
                lo = a1 * (pos + 1) // a2
                hi = (a1 + 1) * (pos + 1) // a2
                for b0 in range(lo, hi, BTK):
                    if KV_RING == KV_ROWS:
                        t = _issue_kv_rows(d_k, d_v, row0 + b0, t, ring, ready, empty, NS, INFLIGHT, SB * KT, BTK,
                                           HD)
                    else:
                        t = _issue_kv(d_k, d_v, row0 + b0, t, ring, ready, empty, NS, INFLIGHT, SB * KT, BTK, HD,
                                      KV_RING, kc_ptr, vc_ptr, NL * NKV * S, CPF)
        elif op == OP_LM_HEAD:
            t = _load_k(d_lm, layer * 0, a0, a1, a0 * 0, a0 * 0 + H, t, ring, ready, empty, NS, INFLIGHT, SB, BK,
                        BOX_BYTES, MMA, KW, TILE, XR, KT, lm_head_ptr, V, H, CPF)
        if TRACE:
            tr = trace_ptr + gl.load(ins_ptr + qi * ROWW + FIDX).to(gl.int64) * TRACE_W
            gl.store(tr + 4, t_reach)
            gl.store(tr + 5, ptx.gl_globaltimer())
        qi += 1
        op, layer, a0, a1, a2, a3 = n_op, n_layer, n_a0, n_a1, n_a2, n_a3


# -- compute partition -------------------------------------------------------------------------------------------


@gluon.jit
def _release(t, empty, NS: gl.constexpr):
    """Hand slot t % NS back to the loader once every compute warp is done reading it."""
    fence_async_shared()  # order the generic-proxy reads before the loader's next async (TMA) write of the slot
    gl.thread_barrier()
    mbarrier.arrive(empty.index(t % NS))
    return t + 1


@gluon.jit
def _consume_pair(t, acc1, acc2, ring, ready, empty, vbuf, kb, nkb, okb, blk: gl.constexpr, NS: gl.constexpr,
                  SB: gl.constexpr):
    """acc1/acc2 += box a/b rows x v over the slot's K chunks kb .. kb + SB/2 - 1 (those below nkb); box b only when
    okb (otherwise it was not loaded)."""
    s = t % NS
    mbarrier.wait(ready.index(s), (t // NS) & 1)
    for j in gl.static_range(SB // 2):
        if kb + j < nkb:
            v = gl.expand_dims(_vchunk(vbuf, kb + j, blk), 0)
            acc1 += ptx.gl_bf16_to_f32(ring.index(SB * s + 2 * j).load(blk)) * v
            if okb:
                acc2 += ptx.gl_bf16_to_f32(ring.index(SB * s + 2 * j + 1).load(blk)) * v
    return _release(t, empty, NS), acc1, acc2


@gluon.jit
def _pair_rows(t, ring, ready, empty, vbuf, vstage, nkb, okb, blk: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr,
               BK: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr):
    """The dot products of one row-paired slot sequence (box a's and box b's 16 rows over K chunks 0 .. nkb - 1) with
    the staged vector: (t, y_a, y_b), [16] each in SliceLayout(1, blk). y_b is meaningless unless okb."""
    if MMA:
        t, y1, y2 = _pair_rows_mma(t, ring, ready, empty, vstage, nkb, blk, NS, SB, BK, num_warps)
    else:
        acc1 = gl.zeros([BR, BK], gl.float32, blk)
        acc2 = gl.zeros([BR, BK], gl.float32, blk)
        for kb in range(0, nkb, SB // 2):
            t, acc1, acc2 = _consume_pair(t, acc1, acc2, ring, ready, empty, vbuf, kb, nkb, okb, blk, NS, SB)
        y1 = gl.sum(acc1, axis=1)
        y2 = gl.sum(acc2, axis=1)
    return t, y1, y2


@gluon.jit
def _mma_slots(t, ring, ready, empty, xs, nkb, acc, NS: gl.constexpr, KT: gl.constexpr, KEEP: gl.constexpr = False,
               kb0=0, held=False):
    """acc += slot t + kb's KT [M, 64] weight tiles times staged chunks KT kb .. KT kb + KT - 1's operand
    (transposed), kb0 <= kb < nkb, on the tensor cores. One slot's wgmmas in flight: slot t - 1 goes back to the
    loader once slot t's are issued and t - 1's have completed. With KEEP the last slot stays with the compute warps
    (the caller releases it: `_slot_exchange`, or the next call with `held`, which hands it back with its first
    slot's products: `_staged_rows_batch`)."""
    M: gl.constexpr = acc.shape[0]
    slots = ring._reinterpret(gl.bfloat16, [NS * KT, M, SUB], MMA_SMEM)
    for kb in range(kb0, nkb):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        for q in gl.static_range(KT):
            acc = warpgroup_mma(slots.index(KT * s + q), xs.index(KT * kb + q).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=KT, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((t + NS - 1) % NS), pred=(kb > kb0) | held)
        t += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if not KEEP:
        gl.thread_barrier()
        mbarrier.arrive(empty.index((t + NS - 1) % NS))
    return t, acc


@gluon.jit
def _slot_exchange(t, ring, empty, z, out: gl.constexpr, NS: gl.constexpr, KT: gl.constexpr, KP: gl.constexpr = 1):
    """z ([2, GR, N] fp32, N <= 32, any layout) in layout `out`, exchanged through slot t - 1 of the ring (KT [128,
    64] bf16 tiles), whose weights the products have consumed (`_mma_slots` with KEEP), and the slot handed back to
    the loader: a layout conversion without the compiler's shared scratch, which would cost a batch build a ring
    slot. With KP > 1 (`_pair_rows_batch`'s K-packed tiles) the result is [2, GR / KP, N / KP]: the sum of z's KP
    diagonal blocks."""
    N: gl.constexpr = z.shape[2]
    Q: gl.constexpr = KT * 2 * GR * SUB * 2 // (2 * GR * N * 4)  # such [2, GR, N] blocks per slot
    gl.static_assert(Q * 2 * GR * N * 4 == KT * 2 * GR * SUB * 2, "whole [2, GR, N] fp32 blocks per slot")
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    buf = ring._reinterpret(gl.float32, [NS * Q, 2 * GR, N], flat).index(Q * ((t + NS - 1) % NS)).reshape([2, GR, N])
    gl.thread_barrier()  # every warp's products have read the slot
    buf.store(z)
    gl.thread_barrier()
    if KP > 1:
        RQ: gl.constexpr = GR // KP
        NQ: gl.constexpr = N // KP
        z = buf.slice(0, RQ, dim=1).slice(0, NQ, dim=2).load(out)
        for g in gl.static_range(1, KP):
            z += buf.slice(g * RQ, RQ, dim=1).slice(g * NQ, NQ, dim=2).load(out)
    else:
        z = buf.load(out)
    _release(t - 1, empty, NS)
    return z


@gluon.jit
def _pair_rows_mma(t, ring, ready, empty, xs, nkb, blk: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr,
                   BK: gl.constexpr, num_warps: gl.constexpr):
    """`_pair_rows` on the tensor cores. A slot's two boxes are one [128, 64] wgmma operand (row 4 i + q of a box is
    its row i over K columns [64 q, 64 q + 64) of the chunk), the staged chunk is [64, 8]: column q the hi bf16 half
    of the vector's sub-chunk q, column 4 + q its lo half (x - hi), so a row's dot product is the sum over q of its
    columns q and 4 + q: fp32-like accuracy from bf16 operands, in an MMA whose M and N the matvec leaves idle anyway
    (`_mma_slots`)."""
    NQ: gl.constexpr = BK // SUB
    M: gl.constexpr = SB * NQ * BR
    accl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, 8, 16])
    t, acc = _mma_slots(t, ring, ready, empty, xs, nkb, gl.zeros([M, 2 * NQ], gl.float32, accl), NS, 1)
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, accl))
    cols = gl.arange(0, 2 * NQ, layout=gl.SliceLayout(0, accl))
    sel = gl.expand_dims(cols % NQ, 0) == gl.expand_dims(rows % NQ, 1)
    r = gl.sum(gl.where(sel, acc, 0.0), axis=1)
    yl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    y = gl.convert_layout(gl.sum(gl.reshape(r, [SB, BR, NQ]), axis=2), yl)  # [box, row]: a sum within each warp
    box = gl.expand_dims(gl.arange(0, SB, layout=gl.SliceLayout(1, yl)), 1)
    y1 = gl.sum(gl.where(box == 0, y, 0.0), axis=0)
    y2 = gl.sum(gl.where(box == 1, y, 0.0), axis=0)
    return t, gl.convert_layout(y1, gl.SliceLayout(1, blk)), gl.convert_layout(y2, gl.SliceLayout(1, blk))


@gluon.jit
def _store_operand(xs, v, NCHK: gl.constexpr, BK: gl.constexpr):
    """xs[:NCHK] <- v ([NCHK, BK] fp32) as `_pair_rows_mma`'s B operand: per chunk, [8, 64] bf16 rows q = hi halves
    of its 64-element sub-chunks, rows 4 + q = lo halves; then a proxy fence (wgmma reads through the async proxy)."""
    NQ: gl.constexpr = BK // SUB
    v3 = gl.reshape(v, [NCHK, NQ, SUB])
    hi = v3.to(gl.bfloat16)
    lo = (v3 - hi.to(gl.float32)).to(gl.bfloat16)
    op = gl.reshape(gl.permute(gl.join(hi, lo), (0, 3, 1, 2)), [NCHK * 2 * NQ, SUB])
    xs._reinterpret(gl.bfloat16, [NCHK * 2 * NQ, SUB], MMA_SMEM).store(op)
    fence_async_shared()


@gluon.jit
def _vchunk(vbuf, i, blk: gl.constexpr):
    """Chunk i (BK fp32) of the staged activation vector, laid out to broadcast over a box's rows."""
    return vbuf.index(i).load(gl.SliceLayout(0, blk))


@gluon.jit
def _stage(vstage, src_ptr, nw_ptr, k0, k1, NORM: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr,
           blk: gl.constexpr, MMA: gl.constexpr, tr, TRACE: gl.constexpr):
    """vstage[:NCHK] <- src[k0:k1] as [NCHK, BK] chunks (times the norm weight when NORM), zero-padded; returns the
    sum of squares of src[k0:k1] (the RMS norm's, when NORM: its rstd is applied to the dot products at the end).
    One load of the whole vector (every chunk in flight at once) and one reduction: the stage costs one L2 round
    trip, not one per chunk."""
    rr = gl.arange(0, NCHK, layout=gl.SliceLayout(1, blk))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    idx = gl.expand_dims(rr, 1) * BK + gl.expand_dims(cc, 0)
    m = idx < k1 - k0
    if NORM:  # the norm weight's load goes with the vector's, not after the CTA reduction of the sum of squares
        w = gl.load(nw_ptr + idx, mask=m, other=0.0)
    v = gl.load(src_ptr + k0 + idx, mask=m, other=0.0, cache_modifier=".cg")
    ss = 0.0
    if NORM:
        ss = gl.sum(gl.sum(v * v, axis=1), axis=0)
        v = v * w
    if MMA:
        _store_operand(vstage, v, NCHK, BK)
    else:
        vstage.slice(0, NCHK).store(v)
    gl.thread_barrier()
    if TRACE:  # the trace row's staged field (megasynth/kernels/gpu/pack.py)
        gl.store(tr + 6, ptx.gl_globaltimer())
    return ss


@gluon.jit
def _op_qkv(ring, ready, empty, vbuf, vstage, t, x_ptr, nw_ptr, b_ptr, qkn_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr,
            sin_ptr, sq_ptr, knew_ptr, layer, a0, a1, pos, H: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr,
            HD: gl.constexpr, S: gl.constexpr, EPS: gl.constexpr, QKV_BIAS: gl.constexpr, QK_NORM: gl.constexpr,
            SQ: gl.constexpr, QG: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr, NCHH: gl.constexpr,
            BK: gl.constexpr, blk: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr, tr, TRACE: gl.constexpr):
    """Pair-ordered rows [a0, a1) of wqkv @ rmsnorm(x): per group of <= 16 RoPE pairs of one head, box a holds the
    pairs' first-half rows and box b their second-half rows; RoPE on q and k heads, k/v into the cache at pos.

    With QKV_BIAS (Qwen2) the rows' bias is added after the norm's scale. With QK_NORM (Qwen3) each q and k head is
    RMS-normalised (its own weights, `_qk_norm_rope`) before RoPE: the norm needs the whole head's sum of squares and a
    head spans hd / 32 groups, so the head's groups are kept unrotated in registers ([16, QG] per half, column g =
    group g) and rotated once its last group is in (the tile holds whole q and k heads: the catalogue's check). Their
    layout has a row's QG columns in one thread's registers (no register holds a copy of another, so the sums count
    each value once) and the rows where `blk`'s row vectors have them (so the group's vectors convert for free).

    With SQ (attn_norm_qkv_rope_sq, QK_NORM False) the QK-norm is applied apart, so any pair range works: a q or k
    pair's sum of squares y1^2 + y2^2 goes to `qk_sq` (sq_ptr) before its norm weight, the weighted pair is rotated
    (the weight is per element, so it goes before RoPE; the head's scale commutes with RoPE and comes in
    qk_norm_apply), q to `q` and k to the fp32 `k_new` (knew_ptr) instead of the cache."""
    HALF: gl.constexpr = HD // 2
    NKH: gl.constexpr = (H + BK - 1) // BK
    QKV: gl.constexpr = (NH + 2 * NKV) * HD
    ss = _stage(vstage, x_ptr, nw_ptr + layer * H, a0 * 0, a0 * 0 + H, True, NCHH, BK, blk, MMA, tr, TRACE)
    rstd = 1.0 / gl.sqrt(ss / H + EPS)
    i16 = gl.arange(0, BR, layout=gl.SliceLayout(1, blk))
    if QK_NORM:
        hl: gl.constexpr = gl.BlockedLayout([1, QG], [1, 32], [num_warps, 1], [1, 0])
        gcol = gl.expand_dims(gl.arange(0, QG, layout=gl.SliceLayout(0, hl)), 0)  # [1, QG]: a head's groups
        h1 = gl.zeros([BR, QG], gl.float32, hl)
        h2 = gl.zeros([BR, QG], gl.float32, hl)
    p = a0 // 2
    pend = a1 // 2
    while p < pend:
        head, j, n = _qkv_group(p, pend, HALF, BR)
        jj = j + i16
        m = i16 < n
        if QKV_BIAS:  # loaded before the K loop, as cos/sin: the round trip overlaps the stream
            bias = b_ptr + layer * QKV + head * HD + jj
            b1 = gl.load(bias, mask=m, other=0.0)
            b2 = gl.load(bias + HALF, mask=m, other=0.0)
        if not QK_NORM:
            # the rotation's cos/sin before the K loop: their round trip overlaps the stream instead of following it
            rot = m & (head < NH + NKV)
            cs = gl.load(cos_ptr + pos * HALF + jj, mask=rot, other=0.0)
            sn = gl.load(sin_ptr + pos * HALF + jj, mask=rot, other=0.0)
            if SQ:  # the norm weight's elements j and j + hd/2 (stacked per layer as [q_norm, k_norm])
                nrm = qkn_ptr + layer * (2 * HD) + (head >= NH).to(gl.int32) * HD + jj
                w1 = gl.load(nrm, mask=rot, other=0.0)
                w2 = gl.load(nrm + HALF, mask=rot, other=0.0)
        t, y1, y2 = _pair_rows(t, ring, ready, empty, vbuf, vstage, NKH, p < pend, blk, NS, SB, BK, MMA, num_warps)
        y1 = y1 * rstd
        y2 = y2 * rstd
        if QKV_BIAS:
            y1 = y1 + b1
            y2 = y2 + b2
        if QK_NORM:
            if head < NH + NKV:
                sel = gcol == j // BR
                z1 = gl.convert_layout(gl.where(m, y1, 0.0), gl.SliceLayout(1, hl))
                z2 = gl.convert_layout(gl.where(m, y2, 0.0), gl.SliceLayout(1, hl))
                h1 = gl.where(sel, gl.expand_dims(z1, 1), h1)
                h2 = gl.where(sel, gl.expand_dims(z2, 1), h2)
                if j + n == HALF:  # the head's last group: every column of h1/h2 is this head's
                    _qk_norm_rope(h1, h2, gcol, qkn_ptr, q_ptr, kc_ptr, cos_ptr, sin_ptr, layer, head, pos, NH, NKV,
                                  HD, S, EPS, QG, hl)
            else:
                cb = ((layer * NKV + head - NH - NKV).to(gl.int64) * S + pos) * HD
                gl.store(vc_ptr + cb + jj, y1.to(gl.bfloat16), mask=m)
                gl.store(vc_ptr + cb + HALF + jj, y2.to(gl.bfloat16), mask=m)
        else:
            if head < NH + NKV:  # q and k heads are rotated (HF convention: pair (i, i + hd/2))
                if SQ:
                    gl.store(sq_ptr + head * HALF + jj, y1 * y1 + y2 * y2, mask=m)
                    y1 = y1 * w1
                    y2 = y2 * w2
                o1 = y1 * cs - y2 * sn
                o2 = y2 * cs + y1 * sn
                if head < NH:
                    gl.store(q_ptr + head * HD + jj, o1, mask=m)
                    gl.store(q_ptr + head * HD + HALF + jj, o2, mask=m)
                elif SQ:
                    kb = (head - NH) * HD
                    gl.store(knew_ptr + kb + jj, o1, mask=m)
                    gl.store(knew_ptr + kb + HALF + jj, o2, mask=m)
                else:
                    cb = ((layer * NKV + head - NH).to(gl.int64) * S + pos) * HD
                    gl.store(kc_ptr + cb + jj, o1.to(gl.bfloat16), mask=m)
                    gl.store(kc_ptr + cb + HALF + jj, o2.to(gl.bfloat16), mask=m)
            else:
                cb = ((layer * NKV + head - NH - NKV).to(gl.int64) * S + pos) * HD
                gl.store(vc_ptr + cb + jj, y1.to(gl.bfloat16), mask=m)
                gl.store(vc_ptr + cb + HALF + jj, y2.to(gl.bfloat16), mask=m)
        p += n
    return t


@gluon.jit
def _qk_norm_rope(h1, h2, gcol, qkn_ptr, q_ptr, kc_ptr, cos_ptr, sin_ptr, layer, head, pos, NH: gl.constexpr,
                  NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr, EPS: gl.constexpr, QG: gl.constexpr,
                  hl: gl.constexpr):
    """One whole q or k head (h1: its pairs' first-half values, h2: their partners, [16, QG] with pair 16 g + i at
    [i, g], zero past hd / 2): y * rsqrt(mean(y^2) + eps) * (q_norm or k_norm), then RoPE, then q to `q` or k into
    the cache at pos. The norm weights are stacked per layer as [q_norm, k_norm]."""
    HALF: gl.constexpr = HD // 2
    i16 = gl.arange(0, BR, layout=gl.SliceLayout(1, hl))
    inv = 1.0 / gl.sqrt(gl.sum(gl.sum(h1 * h1 + h2 * h2, axis=1), axis=0) / HD + EPS)
    is_k = head >= NH
    nrm = qkn_ptr + layer * (2 * HD) + is_k.to(gl.int32) * HD
    cb = ((layer * NKV + head - NH).to(gl.int64) * S + pos) * HD
    for g in gl.static_range(QG):
        if g * BR < HALF:
            jj = g * BR + i16
            m = jj < HALF
            w1 = gl.load(nrm + jj, mask=m, other=0.0)
            w2 = gl.load(nrm + HALF + jj, mask=m, other=0.0)
            cs = gl.load(cos_ptr + pos * HALF + jj, mask=m, other=0.0)
            sn = gl.load(sin_ptr + pos * HALF + jj, mask=m, other=0.0)
            col = gcol == g
            y1 = gl.sum(gl.where(col, h1, 0.0), axis=1) * inv * w1
            y2 = gl.sum(gl.where(col, h2, 0.0), axis=1) * inv * w2
            o1 = y1 * cs - y2 * sn
            o2 = y2 * cs + y1 * sn
            if is_k:
                gl.store(kc_ptr + cb + jj, o1.to(gl.bfloat16), mask=m)
                gl.store(kc_ptr + cb + HALF + jj, o2.to(gl.bfloat16), mask=m)
            else:
                gl.store(q_ptr + head * HD + jj, o1, mask=m)
                gl.store(q_ptr + head * HD + HALF + jj, o2, mask=m)


@gluon.jit
def _op_qk_apply(q_ptr, sq_ptr, knew_ptr, kc_ptr, pos_ptr, layer, g, k_only, pos, NB: gl.constexpr,
                 NBP: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr,
                 EPS: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, num_warps: gl.constexpr):
    """qk_norm_apply of KV head g for all NB sequences at once: its G query heads times rsqrt(mean square + eps) in
    place, and its new k row (`k_new`, weighted and roped by attn_norm_qkv_rope_sq) so scaled into the cache at the
    sequence's position, bf16. The means come from each head's per-pair sums of squares in `qk_sq` (hd / 2 values,
    read as the first half of an [.., hd] row so that the head's values and its sums share one layout). Sequence b's
    q, `qk_sq` and `k_new` lie at b times one sequence's part, its position at pos_ptr[b] (batch 1: `pos`), its cache
    slot is layer * NB + b. No weights: every load is one L2 round trip, up to `QK_APPLY_VALUES` q values in flight
    at once, then every sequence's k row (one sequence after the other, a round trip each, took 6.3 us at batch 8
    and 13.1 at 16 on qwen3-1.7b; so 1.5 and 2.0), and the data was written by other workers before this
    instruction's waits (hence `.cg`). With `k_only` (attention normalised its q heads itself) only the k rows."""
    HALF: gl.constexpr = HD // 2
    SQN: gl.constexpr = (NH + NKV) * HALF  # one sequence's sums of squares
    # sequences whose q heads go at once: the batch, or as many as `QK_APPLY_VALUES` values hold (at least one)
    QB: gl.constexpr = NBP if NBP * GP * HD <= QK_APPLY_VALUES else (
        QK_APPLY_VALUES // (GP * HD) if GP * HD <= QK_APPLY_VALUES else 1)
    # a row's values in 16-byte vectors where it has 4 a lane (128-dim heads: one load instruction each)
    VEC: gl.constexpr = 4 if HD >= 128 else (2 if HD >= 64 else 1)
    L2: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [num_warps, 1], [1, 0])
    d = gl.expand_dims(gl.arange(0, HD, layout=gl.SliceLayout(0, L2)), 0)  # [1, HD]
    b = gl.arange(0, NBP, layout=gl.SliceLayout(1, L2))
    bm = gl.expand_dims(b < NB, 1)
    bb = gl.expand_dims(b, 1)
    if NB == 1:
        p = bb * 0 + pos
    else:
        p = gl.expand_dims(gl.load(pos_ptr + b, mask=b < NB, other=0), 1)
    if k_only == 0:
        r = gl.arange(0, QB * GP, layout=gl.SliceLayout(1, L2))
        for b0 in range(0, NB, QB):
            rb = b0 + r // GP
            rh = g * G + r % GP
            rm = gl.expand_dims((r % GP < G) & (rb < NB), 1)
            qoffs = gl.expand_dims(rb * (NH * HD) + rh * HD, 1) + d
            sq = gl.load(sq_ptr + gl.expand_dims(rb * SQN + rh * HALF, 1) + d, mask=rm & (d < HALF), other=0.0,
                         cache_modifier=".cg")
            q = gl.load(q_ptr + qoffs, mask=rm, other=0.0, cache_modifier=".cg")
            inv = 1.0 / gl.sqrt(gl.sum(sq, axis=1) / HD + EPS)
            # q is scaled in place and a [QB * GP, hd] tensor can be smaller than the CTA (its layout then repeats
            # it across warps): every warp's loads of q come before any warp's store
            gl.thread_barrier()
            gl.store(q_ptr + qoffs, q * gl.expand_dims(inv, 1), mask=rm)
    ksq = gl.load(sq_ptr + bb * SQN + (NH + g) * HALF + d, mask=bm & (d < HALF), other=0.0, cache_modifier=".cg")
    k = gl.load(knew_ptr + bb * (NKV * HD) + g * HD + d, mask=bm, other=0.0, cache_modifier=".cg")
    kinv = 1.0 / gl.sqrt(gl.sum(ksq, axis=1) / HD + EPS)
    cb = (((layer * NB + bb) * NKV + g).to(gl.int64) * S + p) * HD
    gl.store(kc_ptr + cb + d, (k * gl.expand_dims(kinv, 1)).to(gl.bfloat16), mask=bm)


@gluon.jit
def _op_gate_up(ring, ready, empty, vbuf, vstage, t, x_ptr, nw_ptr, act_ptr, layer, a0, a1, H: gl.constexpr,
                EPS: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr, NCHH: gl.constexpr, BK: gl.constexpr,
                blk: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr, tr, TRACE: gl.constexpr):
    """act[a0:a1] = silu(w_gate @ h) * (w_up @ h), h = rmsnorm(x) * mlp_norm; box a gate rows, box b up rows."""
    NKH: gl.constexpr = (H + BK - 1) // BK
    ss = _stage(vstage, x_ptr, nw_ptr + layer * H, a0 * 0, a0 * 0 + H, True, NCHH, BK, blk, MMA, tr, TRACE)
    rstd = 1.0 / gl.sqrt(ss / H + EPS)
    i16 = gl.arange(0, BR, layout=gl.SliceLayout(1, blk))
    for r in range(a0, a1, BR):
        t, g, u = _pair_rows(t, ring, ready, empty, vbuf, vstage, NKH, r < a1, blk, NS, SB, BK, MMA, num_warps)
        g = g * rstd
        u = u * rstd
        rows = r + i16
        gl.store(act_ptr + rows, g / (1.0 + gl.exp(-g)) * u, mask=rows < a1)
    return t


@gluon.jit
def _op_kpaired(ring, ready, empty, vbuf, vstage, t, src_ptr, nw_ptr, out_ptr, a0, a1, k0, k1, NORM: gl.constexpr,
                RESIDUAL: gl.constexpr, H: gl.constexpr, EPS: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr,
                NCHK: gl.constexpr, BK: gl.constexpr, blk: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr,
                tr, TRACE: gl.constexpr, KW: gl.constexpr = 0):
    """out[a0:a1] (+)= W[a0:a1, k0:k1] @ v: o_proj/down (v = attn/act, residual atomics into x) and the LM head
    (v = rmsnorm(x) * final_norm, plain stores); slots in `_load_k`'s order (rows r and r + 16 over one K chunk).
    With KW > 0 (down under `StreamConfig.down_window`; residual, no norm) K goes in `_load_k`'s windows: each
    staged into NCHK chunks and multiplied in turn, its products added into x."""
    if KW > 0:
        for w0 in range(k0, k1, KW):
            w1 = gl.minimum(w0 + KW, k1)
            _stage(vstage, src_ptr, nw_ptr, w0, w1, False, NCHK, BK, blk, MMA, tr, TRACE)
            t = _matvec_k(ring, ready, empty, vbuf, vstage, t, out_ptr, a0, a1, w0, w1, 1.0, RESIDUAL, NS, SB, BK,
                          blk, MMA, num_warps)
            gl.thread_barrier()  # every warp is done with this window before the next is staged over it
        return t
    ss = _stage(vstage, src_ptr, nw_ptr, k0, k1, NORM, NCHK, BK, blk, MMA, tr, TRACE)
    scale = 1.0
    if NORM:
        scale = 1.0 / gl.sqrt(ss / H + EPS)
    return _matvec_k(ring, ready, empty, vbuf, vstage, t, out_ptr, a0, a1, k0, k1, scale, RESIDUAL, NS, SB, BK, blk,
                     MMA, num_warps)


@gluon.jit
def _op_reduce_oproj(ring, ready, empty, vbuf, vstage, t, opart_ptr, lse_ptr, x_ptr, a0, a1, k0, k1, splits,
                     NH: gl.constexpr, HD: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr, NCHK: gl.constexpr,
                     BK: gl.constexpr, SP: gl.constexpr, HBLK: gl.constexpr, blk: gl.constexpr, MMA: gl.constexpr,
                     num_warps: gl.constexpr, tr, TRACE: gl.constexpr):
    """attn_reduce folded into o_proj: x[a0:a1] += wo[a0:a1, k0:k1] @ attn[k0:k1], where attn[k0:k1] (whole heads)
    is merged from the attention splits into the staging buffer here instead of being read from `attn`: the
    instruction waits for the partials directly, one counter hop less than attn_reduce -> o_proj."""
    _stage_merged(vstage, opart_ptr, lse_ptr, k0, k1, splits, NH, HD, NCHK, BK, SP, HBLK, MMA, num_warps)
    if TRACE:
        gl.store(tr + 6, ptx.gl_globaltimer())
    return _matvec_k(ring, ready, empty, vbuf, vstage, t, x_ptr, a0, a1, k0, k1, 1.0, True, NS, SB, BK, blk, MMA,
                     num_warps)


@gluon.jit
def _matvec_k(ring, ready, empty, vbuf, vstage, t, out_ptr, a0, a1, k0, k1, scale, RESIDUAL: gl.constexpr,
              NS: gl.constexpr, SB: gl.constexpr, BK: gl.constexpr, blk: gl.constexpr, MMA: gl.constexpr,
              num_warps: gl.constexpr):
    """out[a0:a1] (+)= scale * W[a0:a1, k0:k1] @ vbuf, consuming the ring's slots in `_load_k`'s order: 32 rows at a
    time (one activation chunk per slot for both 16-row boxes, as gate/up)."""
    nkb = (k1 - k0 + BK - 1) // BK
    i16 = gl.arange(0, BR, layout=gl.SliceLayout(1, blk))
    for r in range(a0, a1, 2 * BR):
        two = r + BR < a1
        t, y1, y2 = _pair_rows(t, ring, ready, empty, vbuf, vstage, nkb, two, blk, NS, SB, BK, MMA, num_warps)
        _store_rows(out_ptr, r + i16, y1 * scale, a1, RESIDUAL)
        if two:
            _store_rows(out_ptr, r + BR + i16, y2 * scale, a1, RESIDUAL)
    return t


@gluon.jit
def _store_rows(out_ptr, rows, y, a1, RESIDUAL: gl.constexpr):
    """out[rows] (+)= y for the rows below a1: a residual add (relaxed atomics into x) or a plain store."""
    if RESIDUAL:
        gl.atomic_add(out_ptr + rows, y, mask=rows < a1, sem="relaxed", scope="gpu")
    else:
        gl.store(out_ptr + rows, y, mask=rows < a1)


@gluon.jit
def _op_embed(embed_ptr, x_ptr, token, start, end, H: gl.constexpr, BE: gl.constexpr, num_warps: gl.constexpr):
    """x[start:end] = embed[token, start:end]."""
    lay: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    offs0 = gl.arange(0, BE, layout=lay)
    for e in range(start, end, BE):
        offs = e + offs0
        m = offs < end
        v = gl.load(embed_ptr + token.to(gl.int64) * H + offs, mask=m, other=0.0)
        gl.store(x_ptr + offs, v.to(gl.float32), mask=m)


@gluon.jit
def _op_embed_batch(embed_ptr, x_ptr, rt_ptr, start, end, H: gl.constexpr, BE: gl.constexpr, NB: gl.constexpr,
                    NBP: gl.constexpr, num_warps: gl.constexpr):
    """x[b, start:end] = embed[token b, start:end] for every sequence b (its token at rt[b]), every sequence's
    columns in one load of at most 8 K values a pass, where `_op_embed` a sequence at a time waits for each BE
    columns of each in turn."""
    WR: gl.constexpr = min(NBP, num_warps)  # warps along the sequences, the rest along the columns
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WR, num_warps // WR], [1, 0])
    EB: gl.constexpr = min(8192 // NBP, 4 * BE)
    bb = gl.arange(0, NBP, layout=gl.SliceLayout(1, lay))
    ok = gl.expand_dims(bb < NB, 1)
    src = embed_ptr + gl.expand_dims(gl.load(rt_ptr + bb, mask=bb < NB, other=0).to(gl.int64) * H, 1)
    dst = x_ptr + gl.expand_dims(bb * H, 1)
    cols0 = gl.expand_dims(gl.arange(0, EB, layout=gl.SliceLayout(0, lay)), 0)
    for e in range(start, end, EB):
        cols = e + cols0
        m = ok & (cols < end)
        v = gl.load(src + cols, mask=m, other=0.0)
        gl.store(dst + cols, v.to(x_ptr.dtype.element_ty), mask=m)


@gluon.jit
def _exp(x, EXP2: gl.constexpr):
    """e^x, or with EXP2 (scores already in base 2: `StreamConfig.attn_exp2`) 2^x in one flush-to-zero MUFU.EX2."""
    if EXP2:
        return ptx.gl_exp2_ftz(x)
    else:
        return gl.exp(x)


@gluon.jit
def _attn_block(q3, k, v, t0, hi, m_i, l_i, acc, ts_s, EXP2: gl.constexpr):
    """Fold positions t0 + [0, BT) (those below hi) into every position lane's online softmax (base 2 with EXP2)."""
    s = gl.sum(q3 * gl.expand_dims(k, 0), axis=2)  # [GP, BT]
    s = gl.where(gl.expand_dims(t0 + ts_s < hi, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, s)
    alpha = _exp(m_i - m_new, EXP2)
    p = _exp(s - m_new, EXP2)
    l_i = l_i * alpha + p
    acc = acc * gl.expand_dims(alpha, 2) + gl.expand_dims(p, 2) * gl.expand_dims(v, 0)
    return m_new, l_i, acc


@gluon.jit
def _load_q(q_ptr, sq_ptr, rows, dims, ok, nq, SCALE: gl.constexpr, HD: gl.constexpr, EPS: gl.constexpr,
            QK_NORM: gl.constexpr, AX: gl.constexpr):
    """q of query heads `rows` at dims `dims` (index tensors that broadcast, in any layout; the head dim on axis
    AX), masked by ok and scaled by SCALE; with the QK-norm (QK_NORM and nq: the instruction's qkn) also by each
    head's rsqrt(mean square + eps), from its RoPE pairs' sums of squares ([heads, HD / 2] at sq_ptr)."""
    q = gl.load(q_ptr + rows * HD + dims, mask=ok, other=0.0, cache_modifier=".cg") * SCALE
    if QK_NORM:
        q = q * _head_inv(sq_ptr, rows, dims, ok, nq, HD, EPS, AX)
    return q


@gluon.jit
def _head_inv(sq_ptr, rows, dims, ok, nq, HD: gl.constexpr, EPS: gl.constexpr, AX: gl.constexpr):
    """Each head's (`rows`) rsqrt(mean square + eps) where nq (1 elsewhere), from its RoPE pairs' sums of squares
    ([heads, HD / 2] at sq_ptr, read where `dims` < HD / 2), expanded along the head dim's axis AX."""
    HALF: gl.constexpr = HD // 2
    sqq = gl.load(sq_ptr + rows * HALF + dims, mask=ok & (dims < HALF) & nq, other=0.0, cache_modifier=".cg")
    return gl.expand_dims(gl.where(nq, 1.0 / gl.sqrt(gl.sum(sqq, axis=AX) / HD + EPS), 1.0), AX)


@gluon.jit
def _new_k(sq_ptr, knew_ptr, g, cur, nq, dk, NH: gl.constexpr, HD: gl.constexpr, EPS: gl.constexpr):
    """KV head g's new k row (dims dk, any 1-D layout; zero unless cur and nq) as the cache will hold it: `k_new`
    scaled by rsqrt(mean square + eps) from its pairs' sums of squares, rounded to bf16."""
    HALF: gl.constexpr = HD // 2
    ksq = gl.load(sq_ptr + (NH + g) * HALF + dk, mask=(dk < HALF) & cur & nq, other=0.0, cache_modifier=".cg")
    knew = gl.load(knew_ptr + g * HD + dk, mask=(dk < HD) & cur & nq, other=0.0, cache_modifier=".cg")
    return (knew * (1.0 / gl.sqrt(gl.sum(ksq, axis=0) / HD + EPS))).to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _cur_rows(kc_ptr, vc_ptr, sq_ptr, knew_ptr, row, g, cur, nq, dk, NH: gl.constexpr, HD: gl.constexpr,
              EPS: gl.constexpr, QK_NORM: gl.constexpr):
    """This step's K and V rows (fp32, dims dk: any 1-D layout; zero unless cur), written by QKV and ordered by the
    instruction's wait: from the cache at `row`, k from `_new_k` where the QK-norm is applied here (nq)."""
    cur_v = gl.load(vc_ptr + row + dk, mask=(dk < HD) & cur, other=0.0, cache_modifier=".cg").to(gl.float32)
    cur_k = gl.load(kc_ptr + row + dk, mask=(dk < HD) & cur & (nq == 0), other=0.0,
                    cache_modifier=".cg").to(gl.float32)
    if QK_NORM:
        cur_k = gl.where(nq, _new_k(sq_ptr, knew_ptr, g, cur, nq, dk, NH, HD, EPS), cur_k)
    return cur_k, cur_v


@gluon.jit
def _split_lse(den, mx, empty_split):
    """A split's log-sum-exp per head from its softmax denominator and max, and the denominator to divide by; an
    empty split's is -inf, which the merge weighs 0."""
    safe = gl.where(den > 0, den, 1.0)
    return safe, gl.where(empty_split, float("-inf"), mx + gl.log(safe))


@gluon.jit
def _store_heads(opart_ptr, o, go, do, split, h0, NH: gl.constexpr, G: gl.constexpr, HD: gl.constexpr):
    """Split `split`'s attention output of query heads h0 + go (rows go, dims do in o's layout; heads past G are
    not written)."""
    rows = split * NH + h0 + go
    gl.store(opart_ptr + gl.expand_dims(rows, 1) * HD + gl.expand_dims(do, 0), o, mask=gl.expand_dims(go < G, 1))


@gluon.jit
def _op_attn_partial(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, sq_ptr, knew_ptr, layer, g, split, splits, pos, qkn,
                     t, ring, ready, empty, scratch,
                     NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr, G: gl.constexpr,
                     GP: gl.constexpr, SCALE: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr,
                     NS: gl.constexpr, SB: gl.constexpr, BTK: gl.constexpr, KV_RING: gl.constexpr,
                     ATTN_EXP2: gl.constexpr, num_warps: gl.constexpr, tr=None, TRACE: gl.constexpr = False):
    """Attention of KV head g's query heads over positions [split*T//splits, (split+1)*T//splits), T = pos + 1.

    With KV_RING the loader has already streamed the split's K/V history into the ring (BTK positions per slot:
    positions before pos are never written during a step), so only q and the current position's row come from L2
    after the wait; otherwise K/V are loaded here, the next block's before the current one is computed. KV_RING ==
    KV_MMA reads the ring on the tensor cores (`_attn_ring_mma`); otherwise the CUDA cores, fp32: each of the BT
    position lanes of a block (BT = 32 / lanes along the head dim, times num_warps) keeps its own online softmax
    (max, denominator, weighted sum), so the loop needs no cross-thread reduction but the dot product's, and the
    lanes are merged once at the end.

    With `qkn` (a QK_NORM build's attn_partial with qk_norm 1) q arrives unnormalised: each head is scaled by
    rsqrt(mean square + eps) from its pairs' sums of squares as it is loaded, and the row at pos is the new k row
    from `k_new`, so scaled and rounded as the cache will hold it (qk_norm_apply writes it there after the layer's
    attention), instead of the cache's.

    With TRACE (the CUDA- and tensor-core paths that merge the warps after their loop) the trace row's staged field
    gets when the positions' loop ended: what follows is the warps' merge, the row at pos and the stores."""
    T = pos + 1
    lo = split * T // splits
    hi = (split + 1) * T // splits
    h0 = g * G
    base = (layer * NKV + g).to(gl.int64) * S * HD
    cur = (pos >= lo) & (pos < hi)
    if QK_NORM:
        nq = qkn != 0
    else:
        nq = False
    if KV_RING == KV_MMA:
        t = _attn_ring_mma(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, sq_ptr, knew_ptr, base, g, h0, split, lo, hi,
                           pos, cur, nq, t, ring, ready, empty, scratch, NH, HD, G, GP, SCALE, EPS, QK_NORM, NS, SB,
                           BTK, num_warps)
    else:
        LD: gl.constexpr = min(32, HD // 8)  # lanes along the head dim (8 elements each): exactly HD, no duplicates
        L3: gl.constexpr = gl.BlockedLayout([GP, 1, 8], [1, 32 // LD, LD], [1, num_warps, 1], [2, 1, 0])
        # the merge's heads: GP, or `_attn_ring_rows`' product columns (at least 8, mma.sync's N)
        HN: gl.constexpr = max(8, GP) if KV_RING == KV_ROWS else GP
        # the merge's layout: each (head, dim) output has one owner thread
        LR: gl.constexpr = gl.BlockedLayout([1, num_warps, 1], [1, 1, 32], [min(HN, num_warps), 1,
                                                                            num_warps // min(HN, num_warps)],
                                            [2, 1, 0])
        LO: gl.constexpr = gl.SliceLayout(1, LR)  # [HN, HD]
        go = gl.arange(0, HN, layout=gl.SliceLayout(1, LO))
        do = gl.arange(0, HD, layout=gl.SliceLayout(0, LO))
        # scores in base 2 with ATTN_EXP2: q times log2(e) as well
        QS: gl.constexpr = SCALE * 1.4426950408889634 if ATTN_EXP2 else SCALE
        if KV_RING:
            # its q and rows in the merge's layout, loaded now (masked off unless cur) so the loop hides their latency
            qo = _load_q(q_ptr, sq_ptr, gl.expand_dims(h0 + go, 1), gl.expand_dims(do, 0),
                         gl.expand_dims((go < G) & cur, 1), nq, QS, HD, EPS, QK_NORM, 1)
            cur_k, cur_v = _cur_rows(kc_ptr, vc_ptr, sq_ptr, knew_ptr, base + pos * HD, g, cur, nq, do, NH, HD, EPS,
                                     QK_NORM)
        if KV_RING == KV_ROWS:
            t = _attn_ring_rows(q_ptr, sq_ptr, h0, pos, lo, hi, nq, t, ring, ready, empty, scratch, HD, G, HN, QS,
                                EPS, QK_NORM, NS, SB, BTK, ATTN_EXP2, num_warps)
        else:
            t = _attn_lanes(q_ptr, kc_ptr, vc_ptr, sq_ptr, knew_ptr, base, g, h0, qkn, pos, lo, hi, t, ring, ready,
                            empty, scratch, NH, HD, G, GP, QS, EPS, QK_NORM, NS, SB, BTK, KV_RING, ATTN_EXP2, L3,
                            num_warps)
        if TRACE:  # the trace row's staged field (megasynth/kernels/gpu/pack.py)
            gl.store(tr + 6, ptx.gl_globaltimer())
        # the warps' (max, denominator, weighted sum), which `_attn_lanes` (or `_attn_ring_rows`) left in the staging
        # buffer, merged by one owner thread per (head, dim)
        gl.thread_barrier()
        pv, mv, dv = _lane_views(scratch, HN, HD, num_warps)
        mw = gl.sum(mv.load(LR), axis=2)  # [HN, num_warps]: one value each, summed over a length-1 axis
        dw = gl.sum(dv.load(LR), axis=2)
        mx = gl.max(mw, axis=1)  # [HN]
        ww = _exp(mw - gl.expand_dims(mx, 1), ATTN_EXP2)
        den = gl.convert_layout(gl.sum(dw * ww, axis=1), gl.SliceLayout(1, LO))
        o = gl.sum(pv.load(LR) * gl.expand_dims(ww, 2), axis=1)  # [HN, HD] in LO
        mx = gl.convert_layout(mx, gl.SliceLayout(1, LO))
        if KV_RING:
            if cur:  # the row at pos, left out of the ring loop: one more position for each head
                sc = gl.sum(qo * gl.expand_dims(cur_k, 0), axis=1)
                m_new = gl.maximum(mx, sc)
                alpha = _exp(mx - m_new, ATTN_EXP2)
                pc = _exp(sc - m_new, ATTN_EXP2)
                den = den * alpha + pc
                o = o * gl.expand_dims(alpha, 1) + gl.expand_dims(pc, 1) * gl.expand_dims(cur_v, 0)
                mx = m_new
        if ATTN_EXP2:  # the split's log-sum-exp in base e, as attn_reduce merges it
            mx = mx * 0.6931471805599453
        safe, lse = _split_lse(den, mx, hi <= lo)
        o = gl.where(hi <= lo, 0.0, o / gl.expand_dims(safe, 1))
        _store_heads(opart_ptr, o, go, do, split, h0, NH, G, HD)
        gl.store(lse_ptr + split * NH + h0 + go, lse, mask=go < G)
    return t


@gluon.jit
def _lane_views(scratch, GP: gl.constexpr, HD: gl.constexpr, num_warps: gl.constexpr):
    """The staging buffer as each warp's [GP, HD] weighted sums of attention's position lanes and its [GP] maxima and
    denominators beside them: [GP, num_warps, HD], [GP, num_warps, 1] and [GP, num_warps, 1] fp32 views."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    v = scratch._reinterpret(gl.float32, [GP, num_warps, 2 * HD], flat)  # power-of-two shapes, as views need
    return v.slice(0, HD, dim=2), v.slice(HD, 1, dim=2), v.slice(HD + 1, 1, dim=2)


@gluon.jit
def _attn_lanes(q_ptr, kc_ptr, vc_ptr, sq_ptr, knew_ptr, base, g, h0, qkn, pos, lo, hi, t, ring, ready, empty,
                scratch, NH: gl.constexpr, HD: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, QS: gl.constexpr,
                EPS: gl.constexpr, QK_NORM: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr, BTK: gl.constexpr,
                KV_RING: gl.constexpr, EXP2: gl.constexpr, L3: gl.constexpr, num_warps: gl.constexpr):
    """The CUDA-core attention's position lanes over [lo, hi) (see `_op_attn_partial`), merged within each warp by
    shuffles and left in `scratch` (`_lane_views`) for the caller's merge across warps."""
    LKV: gl.constexpr = gl.SliceLayout(0, L3)  # [BT, HD]
    LQ: gl.constexpr = gl.SliceLayout(1, L3)  # [GP, HD]
    LS: gl.constexpr = gl.SliceLayout(2, L3)  # [GP, BT]
    BT: gl.constexpr = (32 // min(32, HD // 8)) * num_warps  # as the caller's L3
    if QK_NORM:
        nq = qkn != 0
    else:
        nq = False
    cur = (pos >= lo) & (pos < hi)
    gq = gl.arange(0, GP, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, LQ))
    q = _load_q(q_ptr, sq_ptr, gl.expand_dims(h0 + gq, 1), gl.expand_dims(dq, 0), gl.expand_dims(gq < G, 1), nq,
                QS, HD, EPS, QK_NORM, 1)
    tk = gl.arange(0, BT, layout=gl.SliceLayout(1, LKV))
    dk = gl.arange(0, HD, layout=gl.SliceLayout(0, LKV))
    ts_s = gl.arange(0, BT, layout=gl.SliceLayout(0, LS))
    q3 = gl.expand_dims(q, 1)
    m_i = gl.full([GP, BT], -1.0e30, gl.float32, LS)
    l_i = gl.zeros([GP, BT], gl.float32, LS)
    acc = gl.zeros([GP, BT, HD], gl.float32, L3)
    if KV_RING:
        kv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        # The loop skips the row at pos (the split's last, when it holds pos): the loader may have streamed it
        # stale, and this step's own row (written by QKV, ordered by the wait) is folded in after the merge, once
        # per instruction instead of a select on every slot's K and V. The slots are still those of [lo, hi).
        hl = gl.where(cur, pos, hi)
        for b0 in range(lo, hi, BTK):
            s = t % NS
            mbarrier.wait(ready.index(s), (t // NS) & 1)
            kbox = ring.index(SB * s)._reinterpret(gl.bfloat16, [BTK, HD], kv_layout)
            vbox = ring.index(SB * s + 1)._reinterpret(gl.bfloat16, [BTK, HD], kv_layout)
            if BTK == 2 * BT:  # both blocks in one update: one rescale per two positions (docs/perf-notes.md)
                ka = ptx.gl_bf16_to_f32(kbox.slice(0, BT).load(LKV))
                va = ptx.gl_bf16_to_f32(vbox.slice(0, BT).load(LKV))
                kb = ptx.gl_bf16_to_f32(kbox.slice(BT, BT).load(LKV))
                vb = ptx.gl_bf16_to_f32(vbox.slice(BT, BT).load(LKV))
                m_i, l_i, acc = _attn_block2(q3, ka, va, kb, vb, b0, hl, m_i, l_i, acc, ts_s, BT, EXP2)
            else:
                for hb in gl.static_range(BTK // BT):
                    k = ptx.gl_bf16_to_f32(kbox.slice(hb * BT, BT).load(LKV))
                    v = ptx.gl_bf16_to_f32(vbox.slice(hb * BT, BT).load(LKV))
                    m_i, l_i, acc = _attn_block(q3, k, v, b0 + hb * BT, hl, m_i, l_i, acc, ts_s, EXP2)
            t = _release(t, empty, NS)
    else:
        if QK_NORM:  # the row at pos is not in the cache yet
            new_k = gl.expand_dims(_new_k(sq_ptr, knew_ptr, g, cur, nq, dk, NH, HD, EPS), 0)
        kvoff = gl.expand_dims(tk, 1) * HD + gl.expand_dims(dk, 0)
        km = gl.expand_dims(lo + tk < hi, 1)
        kn = gl.load(kc_ptr + base + lo * HD + kvoff, mask=km, other=0.0, cache_modifier=".cg")
        vn = gl.load(vc_ptr + base + lo * HD + kvoff, mask=km, other=0.0, cache_modifier=".cg")
        for t0 in range(lo, hi, BT):
            k = kn.to(gl.float32)
            v = vn.to(gl.float32)
            if QK_NORM:
                k = gl.where(gl.expand_dims(t0 + tk == pos, 1) & nq, new_k, k)
            km = gl.expand_dims(t0 + BT + tk < hi, 1)
            kn = gl.load(kc_ptr + base + (t0 + BT) * HD + kvoff, mask=km, other=0.0, cache_modifier=".cg")
            vn = gl.load(vc_ptr + base + (t0 + BT) * HD + kvoff, mask=km, other=0.0, cache_modifier=".cg")
            m_i, l_i, acc = _attn_block(q3, k, v, t0, hi, m_i, l_i, acc, ts_s, EXP2)
    # each warp's lanes merged by shuffles: its max, its denominator and weighted sum at that max
    NWL: gl.constexpr = BT // num_warps
    m3 = gl.reshape(m_i, [GP, num_warps, NWL])
    mw = gl.max(m3, axis=2)  # [GP, num_warps]
    w3 = _exp(m3 - gl.expand_dims(mw, 2), EXP2)
    dw = gl.sum(gl.convert_layout(gl.reshape(l_i, [GP, num_warps, NWL]), w3.type.layout) * w3, axis=2)
    w = gl.convert_layout(gl.reshape(w3, [GP, BT]), LS)
    part = gl.sum(gl.reshape(acc * gl.expand_dims(w, 2), [GP, num_warps, NWL, HD]), axis=2)
    pv, mv, dv = _lane_views(scratch, GP, HD, num_warps)
    pv.store(part)
    mv.store(gl.expand_dims(mw, 2))
    dv.store(gl.expand_dims(dw, 2))
    return t


@gluon.jit
def _rows_q(q_ptr, sq_ptr, h0, d0, nq, G: gl.constexpr, HN: gl.constexpr, QS: gl.constexpr, HD: gl.constexpr,
            EPS: gl.constexpr, QK_NORM: gl.constexpr, LB: gl.constexpr, num_warps: gl.constexpr):
    """Dims [d0, d0 + 64) of q^T as `_attn_ring_rows`' scores operand ([num_warps, 64, HN], the same for every warp;
    heads past G zero), a bf16 hi/lo pair; with the QK-norm (QK_NORM and nq) each head times its rsqrt(mean square +
    eps) (`_head_inv`, from the sums of squares of all its pairs: the first 64 dims' loads read them)."""
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, LB)))
    n = gl.arange(0, HN, layout=gl.SliceLayout(0, gl.SliceLayout(1, LB)))
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 2)  # [1, 64, 1]
    n3 = gl.expand_dims(gl.expand_dims(n, 0), 1)  # [1, 1, HN]
    q = gl.load(q_ptr + (h0 + n3) * HD + d0 + d3, mask=(n3 < G) & (d3 < 64), other=0.0, cache_modifier=".cg") * QS
    if QK_NORM:
        q = q * _head_inv(sq_ptr, h0 + n3, d3, n3 < G, nq, HD, EPS, 1)
    q = q + gl.zeros([num_warps, 64, HN], gl.float32, LB)
    qh = q.to(gl.bfloat16)
    return qh, (q - qh.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def _attn_ring_rows(q_ptr, sq_ptr, h0, pos, lo, hi, nq, t, ring, ready, empty, scratch, HD: gl.constexpr,
                    G: gl.constexpr, HN: gl.constexpr, QS: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr,
                    NS: gl.constexpr, SB: gl.constexpr, BTK: gl.constexpr, EXP2: gl.constexpr,
                    num_warps: gl.constexpr):
    """`_attn_lanes` on the tensor cores (mma.sync m16n8k16) with the positions as the products' rows: each warp
    takes 16 of a block's BTK = 16 num_warps positions and keeps its own online softmax over them. Its scores are
    K q^T ([16, HN]: the query heads as the HN >= 8 columns, zero past G; q as bf16 hi + lo, K is bf16 in the
    cache), its output V^T P^T ([HD, HN], P in bf16, as a batch's bf16 activations are), both a 64-dim chunk of
    the head at a time (`_issue_kv_rows`' blocks: K and V in one slot, or a 128-dim head's K in one and V in the
    next). So every product row is a real position, where `_attn_ring_mma`'s rows are query heads (4 of 16 real on
    llama-1b). The row at pos is left out, as `_attn_lanes` leaves it; the warps' states go to `scratch` in
    `_lane_views`' form. With the QK-norm here (QK_NORM and nq) q is normalised as it is loaded (`_rows_q`)."""
    gl.static_assert(BTK == 16 * num_warps, "a warp's 16 positions per block")
    gl.static_assert((HD == 64) | (HD == 128), "64- or 128-dim heads")
    DH: gl.constexpr = HD // 64
    KPS: gl.constexpr = SB * ring.shape[1] * ring.shape[2] // (BTK * 64)  # [BTK, 64] blocks per slot
    SPP: gl.constexpr = 2 * DH // KPS  # slots per K/V block pair: 1 or 2
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1, 1],
                                                   instr_shape=[1, 16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2)
    LM: gl.constexpr = gl.SliceLayout(1, MMA3)  # [num_warps, HN]: per warp and head
    kv3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    qh0, ql0 = _rows_q(q_ptr, sq_ptr, h0, 0, nq, G, HN, QS, HD, EPS, QK_NORM, LB, num_warps)
    if DH == 2:
        qh1, ql1 = _rows_q(q_ptr, sq_ptr, h0, 64, nq, G, HN, QS, HD, EPS, QK_NORM, LB, num_warps)
        acc1 = gl.zeros([num_warps, 64, HN], gl.float32, MMA3)
    w = gl.arange(0, num_warps, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA3)))
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA3)))
    prow = gl.expand_dims(gl.expand_dims(w, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(r, 0), 2)  # [nw, 16, 1]
    m_i = gl.full([num_warps, HN], -1.0e30, gl.float32, LM)
    l_i = gl.zeros([num_warps, 16, HN], gl.float32, MMA3)  # summed over the rows after the loop
    acc0 = gl.zeros([num_warps, 64, HN], gl.float32, MMA3)
    hl = gl.where((pos >= lo) & (pos < hi), pos, hi)  # the row at pos left out, as `_attn_lanes` does
    # `_kv_blocks`' [BTK, 64] blocks, each seen as the warps' [16, 64] row groups
    NBLK: gl.constexpr = ring.shape[0] * ring.shape[1] * ring.shape[2] // (BTK * 64)
    kv = ring._reinterpret(gl.bfloat16, [NBLK, num_warps, 16, 64], kv3)
    for b0 in range(lo, hi, BTK):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        if SPP == 2:
            s2 = (t + 1) % NS
            mbarrier.wait(ready.index(s2), ((t + 1) // NS) & 1)
        # block c of the pair (K's chunks, then V's) is block c % KPS of the pair's slot c // KPS
        k0 = kv.index(KPS * s).load(LA)
        sc = mma_v2(k0, qh0, gl.zeros([num_warps, 16, HN], gl.float32, MMA3))
        sc = mma_v2(k0, ql0, sc)
        if DH == 2:
            k1 = kv.index(KPS * s + 1).load(LA)
            sc = mma_v2(k1, qh1, sc)
            sc = mma_v2(k1, ql1, sc)
            v0 = kv.index(KPS * s2)
            v1 = kv.index(KPS * s2 + 1)
        elif SPP == 2:
            v0 = kv.index(KPS * s2)
        else:
            v0 = kv.index(KPS * s + 1)
        sc = gl.where(b0 + prow < hl, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.expand_dims(_exp(m_i - m_new, EXP2), 1)
        p = _exp(sc - gl.expand_dims(m_new, 1), EXP2)
        l_i = l_i * alpha + p
        pb = gl.convert_layout(p.to(gl.bfloat16), LB)
        acc0 = mma_v2(v0.permute([0, 2, 1]).load(LA), pb, acc0 * alpha)
        if DH == 2:
            acc1 = mma_v2(v1.permute([0, 2, 1]).load(LA), pb, acc1 * alpha)
        m_i = m_new
        t = _release(t, empty, NS)
        if SPP == 2:
            t = _release(t, empty, NS)
    pv, mv, dv = _lane_views(scratch, HN, HD, num_warps)
    pv.slice(0, 64, dim=2).store(gl.permute(acc0, [2, 0, 1]))
    if DH == 2:
        pv.slice(64, 64, dim=2).store(gl.permute(acc1, [2, 0, 1]))
    mv.store(gl.permute(gl.expand_dims(m_i, 1), [2, 0, 1]))
    dv.store(gl.permute(gl.expand_dims(gl.sum(l_i, axis=1), 1), [2, 0, 1]))
    return t


#: `_op_attn_partial` as a function of its own (`StreamConfig.attn_call`): inlined into the instruction loop, the
#: compiler keeps every op's loop-invariant index arithmetic in registers across it and schedules the ring loop's
#: reductions one after another (docs/perf-notes.md). Its CTA barriers become the compute partition's
#: (`ptx.partition_barriers`).
_attn_partial_call = gluon.jit(noinline=True)(_op_attn_partial.fn)


@gluon.jit
def _attn_ring_mma(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, sq_ptr, knew_ptr, base, g, h0, split, lo, hi, pos, cur,
                   nq, t, ring, ready, empty, scratch, NH: gl.constexpr, HD: gl.constexpr, G: gl.constexpr,
                   GP: gl.constexpr, SCALE: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr,
                   NS: gl.constexpr, SB: gl.constexpr, BTK: gl.constexpr, num_warps: gl.constexpr):
    """`_op_attn_partial` on the tensor cores (mma.sync m16n8k16): each ring slot's BTK positions are NWB groups of
    16, one per warp row, and each group keeps its own online softmax over its positions (a batched product with the
    group as the batch dimension, so no reduction crosses warps inside the loop). Scores = q K^T with q's heads as
    the 16 rows of the product (GP of them real, the rest zero) and q in bf16 hi + lo (~16 mantissa bits; K is bf16
    in the cache), then out += P V with P in bf16 hi + lo: about fp32 accuracy, at 32 products per warp per slot
    where the CUDA cores spend ~4x the instructions. With more warps than groups the extra warps compute further
    zero rows. The row at pos comes from L2 (`_cur_rows`): its score replaces the stale row's, and its weight
    multiplies the current V row outside the product. The groups merge through `scratch` ([NWB, 16 WM, HD] fp32,
    `stream_geometry` leaves room)."""
    NWB: gl.constexpr = BTK // 16  # position groups per slot
    WM: gl.constexpr = num_warps // NWB  # warps per group, along the product's rows
    GM: gl.constexpr = 16 * WM  # product rows: the query heads, zero past G
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NWB, WM, 1], instr_shape=[1, 16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2)
    LM: gl.constexpr = gl.SliceLayout(2, MMA3)  # [NWB, GM]: per group and head
    kv3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    r = gl.arange(0, GM, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA)))
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA)))
    r3 = gl.expand_dims(gl.expand_dims(r, 0), 2)  # [1, GM, 1]
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 1)  # [1, 1, HD]
    q = _load_q(q_ptr, sq_ptr, h0 + r3, d3, (r3 < G) & (d3 < HD), nq, SCALE, HD, EPS, QK_NORM, 2)
    cur_k, cur_v = _cur_rows(kc_ptr, vc_ptr, sq_ptr, knew_ptr, base + pos * HD, g, cur, nq, d, NH, HD, EPS, QK_NORM)
    # the current row's score per head, in fp32, and its V row in the output's layout
    s_cur = gl.convert_layout(gl.sum(q * gl.expand_dims(gl.expand_dims(cur_k, 0), 1), axis=2), LM)  # [1, GM]
    cur_v = gl.expand_dims(gl.expand_dims(gl.convert_layout(cur_v, gl.SliceLayout(0, gl.SliceLayout(1, MMA3))), 0),
                           1)
    q = q + gl.zeros([NWB, GM, HD], gl.float32, LA)  # the same q for every group
    qh = q.to(gl.bfloat16)
    ql = (q - qh.to(gl.float32)).to(gl.bfloat16)
    wb = gl.arange(0, NWB, layout=gl.SliceLayout(1, LM))
    pc = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA3)))
    pidx = gl.expand_dims(gl.expand_dims(wb, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(pc, 0), 1)  # [NWB, 1, 16]
    m_i = gl.full([NWB, GM], -1.0e30, gl.float32, LM)
    l_i = gl.zeros([NWB, GM, 16], gl.float32, MMA3)
    acc = gl.zeros([NWB, GM, HD], gl.float32, MMA3)
    for b0 in range(lo, hi, BTK):
        s = t % NS
        mbarrier.wait(ready.index(s), (t // NS) & 1)
        kbox = ring.index(SB * s)._reinterpret(gl.bfloat16, [NWB, 16, HD], kv3)
        vbox = ring.index(SB * s + 1)._reinterpret(gl.bfloat16, [NWB, 16, HD], kv3)
        k = kbox.permute([0, 2, 1]).load(LB)  # [NWB, HD, 16]: K^T per group
        v = vbox.load(LB)  # [NWB, 16, HD]
        sc = mma_v2(qh, k, gl.zeros([NWB, GM, 16], gl.float32, MMA3))
        sc = mma_v2(ql, k, sc)
        tpos = b0 + pidx
        now = tpos == pos
        has_now = cur & (pos < b0 + BTK) & (pos >= b0)
        if has_now:
            sc = gl.where(now, gl.expand_dims(s_cur, 2), sc)
        sc = gl.where(tpos < hi, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=2))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(sc - gl.expand_dims(m_new, 2))
        l_i = l_i * gl.expand_dims(alpha, 2) + p
        acc = acc * gl.expand_dims(alpha, 2)
        if has_now:
            acc = acc + gl.expand_dims(gl.sum(gl.where(now, p, 0.0), axis=2), 2) * cur_v
            p = gl.where(now, 0.0, p)
        ph = p.to(gl.bfloat16)
        pl = (p - ph.to(gl.float32)).to(gl.bfloat16)
        acc = mma_v2(gl.convert_layout(ph, LA), v, acc)
        acc = mma_v2(gl.convert_layout(pl, LA), v, acc)
        m_i = m_new
        t = _release(t, empty, NS)
    # The groups' merge: weights from the cross-group max, normalised before the store, then each (head, dim)
    # summed over the groups by one owner thread
    mx = gl.max(m_i, axis=0)  # [GM]
    w = gl.exp(m_i - gl.expand_dims(mx, 0))
    safe, lse = _split_lse(gl.sum(gl.sum(l_i, axis=2) * w, axis=0), mx, hi <= lo)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    parts = scratch._reinterpret(gl.float32, [NWB, GM, HD], flat)
    parts.store(acc * gl.expand_dims(w / gl.expand_dims(safe, 0), 2))
    gl.thread_barrier()
    LR: gl.constexpr = gl.BlockedLayout([NWB, 1, 1], [1, 1, 32], [1, min(GP, num_warps),
                                                                   num_warps // min(GP, num_warps)], [2, 1, 0])
    LO: gl.constexpr = gl.SliceLayout(0, LR)  # [GP, HD]
    o = gl.sum(parts.slice(0, GP, dim=1).load(LR), axis=0)  # normalised; zero for an empty split
    _store_heads(opart_ptr, o, gl.arange(0, GP, layout=gl.SliceLayout(1, LO)),
                 gl.arange(0, HD, layout=gl.SliceLayout(0, LO)), split, h0, NH, G, HD)
    gr = gl.arange(0, GM, layout=gl.SliceLayout(0, LM))
    gl.store(lse_ptr + split * NH + h0 + gr, lse, mask=gr < G)
    return t


@gluon.jit
def _add8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """The combine of an eight-operand sum (`_scores2`)."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7


@gluon.jit
def _heads4(x):
    """[4, BT, HD] (the heads in-thread) -> its four heads, each [BT, HD]."""
    y = gl.reshape(gl.permute(x, [1, 2, 0]), [x.shape[1], x.shape[2], 2, 2])
    y0, y1 = gl.split(y)  # g = 2 i + j: j = 0, 1
    h0, h2 = gl.split(y0)
    h1, h3 = gl.split(y1)
    return h0, h1, h2, h3


@gluon.jit
def _join4(h0, h1, h2, h3, layout: gl.constexpr):
    """Four [BT] -> [4, BT] in `layout`."""
    y = gl.join(gl.join(h0, h1), gl.join(h2, h3))  # [BT, j, i]
    return gl.convert_layout(gl.reshape(gl.permute(y, [2, 1, 0]), [4, h0.shape[0]]), layout)


@gluon.jit
def _scores2(q3, ka, kb):
    """Scores [GP, BT] of two blocks: with 4 heads one reduction of all eight dot products, so their lane shuffles
    go out level by level, eight at a time."""
    GP: gl.constexpr = q3.shape[0]
    pa = q3 * gl.expand_dims(ka, 0)
    pb = q3 * gl.expand_dims(kb, 0)
    if GP == 4:
        a0, a1, a2, a3 = _heads4(pa)
        b0, b1, b2, b3 = _heads4(pb)
        r = gl.reduce((a0, a1, a2, a3, b0, b1, b2, b3), 1, _add8)
        LS: gl.constexpr = gl.SliceLayout(2, pa.type.layout)
        return _join4(r[0], r[1], r[2], r[3], LS), _join4(r[4], r[5], r[6], r[7], LS)
    else:
        return gl.sum(pa, axis=2), gl.sum(pb, axis=2)


@gluon.jit
def _attn_block2(q3, ka, va, kb, vb, t0, hi, m_i, l_i, acc, ts_s, BT: gl.constexpr, EXP2: gl.constexpr):
    """`_attn_block` for positions t0 + [0, 2 BT): position lane i takes positions t0 + i and t0 + BT + i in one
    online-softmax update (one rescale of the lane's sum for two positions, and both dot products in flight)."""
    sa, sb = _scores2(q3, ka, kb)
    sa = gl.where(gl.expand_dims(t0 + ts_s < hi, 0), sa, float("-inf"))
    sb = gl.where(gl.expand_dims(t0 + BT + ts_s < hi, 0), sb, float("-inf"))
    m_new = gl.maximum(m_i, gl.maximum(sa, sb))
    alpha = _exp(m_i - m_new, EXP2)
    pa = _exp(sa - m_new, EXP2)
    pb = _exp(sb - m_new, EXP2)
    l_i = l_i * alpha + pa + pb
    acc = (acc * gl.expand_dims(alpha, 2) + gl.expand_dims(pa, 2) * gl.expand_dims(va, 0)
           + gl.expand_dims(pb, 2) * gl.expand_dims(vb, 0))
    return m_new, l_i, acc


@gluon.jit
def _combine(mx, den, acc, lse_ptr, opart_ptr, s, hs, ok, d, NH: gl.constexpr, HD: gl.constexpr):
    """Fold split s (heads hs, lanes ok) into the running (max, denominator, weighted sum) of attn_reduce."""
    ls = gl.load(lse_ptr + s * NH + hs, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = gl.load(opart_ptr + gl.expand_dims(s * NH + hs, 1) * HD + gl.expand_dims(d, 0), mask=gl.expand_dims(ok, 1),
                other=0.0, cache_modifier=".cg")
    m_new = gl.maximum(mx, ls)
    alpha = gl.exp(mx - m_new)
    wgt = gl.exp(ls - m_new)  # an empty split (lse = -inf) weighs 0
    return m_new, den * alpha + wgt, acc * gl.expand_dims(alpha, 1) + gl.expand_dims(wgt, 1) * o


@gluon.jit
def _merge_heads(lse_ptr, opart_ptr, hs, hm, splits, d, NH: gl.constexpr, HD: gl.constexpr, HB: gl.constexpr,
                 SP: gl.constexpr, L2: gl.constexpr):
    """The attention output of query heads hs (lanes hm) merged over `splits` splits, [HB, HD] in layout L2: the
    first SP splits are an unrolled sequence of independent loads (one L2 round trip), as in interpreter v9."""
    mx = gl.full([HB], -1.0e30, gl.float32, gl.SliceLayout(1, L2))
    den = gl.zeros([HB], gl.float32, gl.SliceLayout(1, L2))
    acc = gl.zeros([HB, HD], gl.float32, L2)
    for s in gl.static_range(SP):
        mx, den, acc = _combine(mx, den, acc, lse_ptr, opart_ptr, s, hs, hm & (s < splits), d, NH, HD)
    for s in range(SP, splits):
        mx, den, acc = _combine(mx, den, acc, lse_ptr, opart_ptr, s, hs, hm, d, NH, HD)
    den = gl.where(den > 0, den, 1.0)
    return acc / gl.expand_dims(den, 1)


@gluon.jit
def _stage_merged(vstage, opart_ptr, lse_ptr, k0, k1, splits, NH: gl.constexpr, HD: gl.constexpr,
                  NCHK: gl.constexpr, BK: gl.constexpr, SP: gl.constexpr, HBLK: gl.constexpr, MMA: gl.constexpr,
                  num_warps: gl.constexpr):
    """vstage[:NCHK] <- the attention output of columns [k0, k1) (whole heads) merged over `splits` splits, zero past
    k1 in the chunks the K loop reads. Heads go HBLK at a time (each block's SP split loads all in flight: one L2
    round trip per block); a block wholly past those chunks is skipped. On the tensor-core path the heads go to fp32
    scratch in chunks [NCHK, 2 NCHK) of the staging buffer first (stream_geometry leaves room), then into the
    operand."""
    NHS: gl.constexpr = NCHK * BK // HD  # heads the staged chunks hold (a multiple of HBLK: stream_geometry)
    L2: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [num_warps, 1], [1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    if MMA:
        scratch = vstage._reinterpret(gl.float32, [2 * NCHK, BK], flat).slice(NCHK, NCHK)
    else:
        scratch = vstage
    heads = scratch._reinterpret(gl.float32, [NCHK * BK // HD, HD], flat)
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, L2))
    hb = gl.arange(0, HBLK, layout=gl.SliceLayout(1, L2))
    h0 = k0 // HD
    h1 = k1 // HD
    used = (k1 - k0 + BK - 1) // BK * BK  # elements the K loop reads
    for b in gl.static_range((NHS + HBLK - 1) // HBLK):
        if b * HBLK * HD < used:
            hs = h0 + b * HBLK + hb
            o = _merge_heads(lse_ptr, opart_ptr, hs, hs < h1, splits, d, NH, HD, HBLK, SP, L2)
            heads.slice(b * HBLK, HBLK).store(o)
    gl.thread_barrier()
    if MMA:
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        _store_operand(vstage, scratch._reinterpret(gl.float32, [NCHK, BK], flat).load(blk), NCHK, BK)
        gl.thread_barrier()


@gluon.jit
def _op_attn_reduce(opart_ptr, lse_ptr, attn_ptr, start, end, splits, NH: gl.constexpr, HD: gl.constexpr,
                    HB: gl.constexpr, SP: gl.constexpr, num_warps: gl.constexpr):
    """attn[heads] = sum_s exp(lse_s - logsumexp(lse)) * o_s over the splits, query heads [start, end)."""
    L2: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [num_warps, 1], [1, 0])
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, L2))
    hb = gl.arange(0, HB, layout=gl.SliceLayout(1, L2))
    for hc in range(start, end, HB):
        hs = hc + hb
        hm = hs < end
        o = _merge_heads(lse_ptr, opart_ptr, hs, hm, splits, d, NH, HD, HB, SP, L2)
        gl.store(attn_ptr + gl.expand_dims(hs, 1) * HD + gl.expand_dims(d, 0), o.to(attn_ptr.dtype.element_ty),
                 mask=gl.expand_dims(hm, 1))


# -- batches (NB > 1 sequences per step; the tensor-core path) ---------------------------------------------------


@gluon.jit
def _stage_batch(vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, NORM: gl.constexpr, H: gl.constexpr,
                 EPS: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
                 CG: gl.constexpr, CPS: gl.constexpr, TILE: gl.constexpr, num_warps: gl.constexpr, tr,
                 TRACE: gl.constexpr):
    """A batch's B operand <- every sequence's src[k0:k1] (sequence b's at src + b sstride), zero below klo and for
    the padding sequences [NB, NBP), in the layout of the build's slots (`_stage_tiles`, `_stage_rowpairs`), whole
    before any product. With NORM the values are times the norm weight and each sequence's rstd: the returned [NBP]
    on tiles (the epilogue applies them), in the operand itself on row-pair slots (which return ones). CG is the
    staging's load group: chunks of every sequence on tiles, sequences on row-pair slots. (A tile build whose stage
    takes several groups multiplies as they land instead: `_staged_rows_batch`.)"""
    if TILE:
        rs = _stage_tiles(vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, NORM, H, EPS, NCHK, BK, NB, NBP, CG, CPS,
                          num_warps)
    else:
        rs = _stage_rowpairs(vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, NORM, H, EPS, NCHK, BK, NB, NBP, CG, CPS,
                             num_warps)
    fence_async_shared()
    gl.thread_barrier()
    if TRACE:
        gl.store(tr + 6, ptx.gl_globaltimer())
    return rs


@gluon.jit
def _load_window(src_ptr, seq, sstride, k0, k1, klo, idx, NB: gl.constexpr):
    """Sequences seq's src[k0 + idx] in fp32 where klo <= k0 + idx < k1, zero elsewhere and for the padding
    sequences (seq >= NB), and that mask. The loads take whole 8-element runs (16 B of bf16): their mask is the
    bounds rounded out to multiples of 8 (still inside each sequence's row, whose length is a multiple of 64), the
    exact one is applied in registers, and k0 is a multiple of 64 (a box's first column), so a K window that starts
    anywhere (o_proj's, down's) loads as vectors, not element by element."""
    k0 = gl.multiple_of(k0, SUB)
    hi = gl.multiple_of((k1 - k0 + 7) // 8 * 8, 8)
    lo = gl.multiple_of((klo - k0) // 8 * 8, 8)  # at most klo - k0 where that is positive (idx >= 0 anyway)
    v = gl.load(src_ptr + seq * sstride + k0 + idx, mask=(idx < hi) & (idx >= lo) & (seq < NB), other=0.0,
                cache_modifier=".cg").to(gl.float32)
    m = (idx < k1 - k0) & (idx >= klo - k0)
    return gl.where(m, v, 0.0), m


@gluon.jit
def _tile_load(src_ptr, sstride, nw_ptr, k0, k1, klo, c0, NORM: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr,
               NBP: gl.constexpr, CG: gl.constexpr, num_warps: gl.constexpr):
    """The loads of a tile stage's group c0 .. c0 + CG - 1 of chunks: every sequence's values there ([NBP, CG, BK]
    fp32, `_load_window`) and, with NORM, the norm weight's ([1, CG, BK]; without, the mask). Issued apart from
    `_tile_store` so that they are in flight while the products of the group before run. The warps split the group's
    chunks and, where a group has fewer chunks than warps (a small hidden size), its sequences too, so that no warp
    loads what another does."""
    WC: gl.constexpr = min(CG, num_warps)  # warps along the chunks of a group, the rest along the sequences
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [num_warps // WC, WC, 1], [2, 1, 0])
    bb = gl.arange(0, NBP, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    rr = gl.arange(0, CG, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    seq = gl.expand_dims(gl.expand_dims(bb, 1), 2)  # [NBP, 1, 1]
    idx = gl.expand_dims(gl.expand_dims(c0 + rr, 0), 2) * BK + gl.expand_dims(gl.expand_dims(cc, 0), 1)
    v, m = _load_window(src_ptr, seq, sstride, k0, k1, klo, idx, NB)  # [NBP, CG, BK], [1, CG, BK]
    if NORM:
        w = gl.load(nw_ptr + idx, mask=m, other=0.0)
    else:
        w = m
    return v, w


@gluon.jit
def _tile_store(ops, v, w, c0, NORM: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr, NBP: gl.constexpr,
                BK: gl.constexpr):
    """ops' sub-chunks of group c0 <- `_tile_load`'s values (times the norm weight with NORM) in bf16, row b
    sequence b's and, with hi/lo pairs (CPS = 2), row NBP + b what bf16 left of them; returns each sequence's sum
    of squares over the group ([NBP])."""
    ss = gl.sum(gl.sum(v * v, axis=2), axis=1)  # unused (and dropped by the compiler) without NORM
    if NORM:
        v = v * w
    _store_group(ops, v, c0, CG, CPS, NBP, BK)
    return ss


@gluon.jit
def _store_group(ops, v, c0, CG: gl.constexpr, CPS: gl.constexpr, NBP: gl.constexpr, BK: gl.constexpr):
    """ops' sub-chunks of group c0 <- v ([NBP, CG, BK] fp32) in bf16: row b sequence b's, and with hi/lo pairs (CPS
    = 2) row NBP + b what bf16 left of them."""
    NQ: gl.constexpr = BK // SUB
    v3 = gl.permute(gl.reshape(v, [NBP, CG * NQ, SUB]), (1, 0, 2))  # [sub-chunk, sequence, 64]
    hi = v3.to(gl.bfloat16)
    part = ops.slice(c0 * NQ, CG * NQ, dim=0)
    if CPS == 2:
        part.slice(0, NBP, dim=1).store(hi)
        part.slice(NBP, NBP, dim=1).store((v3 - hi.to(gl.float32)).to(gl.bfloat16))
    else:
        part.store(hi)


@gluon.jit
def _tile_ops(vstage, NCHK: gl.constexpr, BK: gl.constexpr, NBP: gl.constexpr, CPS: gl.constexpr):
    """The staged operand of a tile build as `_tile_store` writes it: [sub-chunk, CPS NBP rows, 64] bf16."""
    return vstage._reinterpret(gl.bfloat16, [NCHK * (BK // SUB), CPS * NBP, SUB], MMA_BOX)


@gluon.jit
def _stage_tiles(vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, NORM: gl.constexpr, H: gl.constexpr,
                 EPS: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
                 CG: gl.constexpr, CPS: gl.constexpr, num_warps: gl.constexpr):
    """`_stage_batch` for `_issue_tile`'s slots: per 64-column sub-chunk of K, row b is sequence b's bf16 values
    and, with hi/lo pairs (CPS = 2), row NBP + b what bf16 left of them. The norm's per-sequence rstd commutes with
    the product, so it is returned for the epilogue, and the operand is staged CG chunks of every sequence at a time
    (whole 8-row swizzle atoms, at most `StreamConfig.stage_values` fp32 values in flight) in one pass. The warps
    split the group's chunks and, where a group has fewer chunks than warps (a small hidden size), its sequences too,
    so that no warp loads what another does. (Written out rather than as `_tile_load` and `_tile_store` in turn:
    ptxas allocates the whole kernel's registers differently then, llama-8b's batch-8 build spills and its step
    measured 1.9 % slower.)"""
    WC: gl.constexpr = min(CG, num_warps)  # warps along the chunks of a group, the rest along the sequences
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [num_warps // WC, WC, 1], [2, 1, 0])
    NQ: gl.constexpr = BK // SUB
    bb = gl.arange(0, NBP, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    rr = gl.arange(0, CG, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    seq = gl.expand_dims(gl.expand_dims(bb, 1), 2)  # [NBP, 1, 1]
    ss = gl.zeros([NBP], gl.float32, gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    ops = vstage._reinterpret(gl.bfloat16, [NCHK * NQ, CPS * NBP, SUB], MMA_BOX)
    for c0 in gl.static_range(0, NCHK, CG):
        idx = gl.expand_dims(gl.expand_dims(c0 + rr, 0), 2) * BK + gl.expand_dims(gl.expand_dims(cc, 0), 1)
        v, m = _load_window(src_ptr, seq, sstride, k0, k1, klo, idx, NB)  # [NBP, CG, BK], [1, CG, BK]
        if NORM:
            ss += gl.sum(gl.sum(v * v, axis=2), axis=1)
            v = v * gl.load(nw_ptr + idx, mask=m, other=0.0)
        _store_group(ops, v, c0, CG, CPS, NBP, BK)
    return 1.0 / gl.sqrt(ss / H + EPS)


@gluon.jit
def _stage_rowpairs(vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, NORM: gl.constexpr, H: gl.constexpr,
                    EPS: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
                    GB: gl.constexpr, CPS: gl.constexpr, num_warps: gl.constexpr):
    """`_stage_batch` for row-pair slots, GB sequences' vectors at a time (one L2 round trip per GB sequences), the
    norm (weight and each sequence's own rstd) applied here: per chunk of BK, row CPS b + q is sequence b's
    sub-chunk q in bf16 and, with hi/lo pairs (CPS = 8), row 8 b + 4 + q what bf16 left of it (`_store_operand`'s
    rows, once per sequence). Returns ones (nothing left for the epilogue to scale)."""
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, num_warps, 1], [2, 1, 0])
    NQ: gl.constexpr = BK // SUB
    bb = gl.arange(0, GB, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    rr = gl.arange(0, NCHK, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    idx = gl.expand_dims(gl.expand_dims(rr, 0), 2) * BK + gl.expand_dims(gl.expand_dims(cc, 0), 1)  # [1, NCHK, BK]
    if NORM:
        w = gl.load(nw_ptr + idx, mask=(idx < k1 - k0) & (idx >= klo - k0), other=0.0)
    rows = vstage._reinterpret(gl.bfloat16, [NCHK, NBP * CPS, SUB], MMA_BOX)
    for g0 in gl.static_range(0, NBP, GB):
        seq = g0 + gl.expand_dims(gl.expand_dims(bb, 1), 2)  # [GB, 1, 1]
        v, m = _load_window(src_ptr, seq, sstride, k0, k1, klo, idx, NB)
        if NORM:
            ss = gl.sum(gl.sum(v * v, axis=2), axis=1)  # [GB]
            rstd = 1.0 / gl.sqrt(ss / H + EPS)
            v = v * w * gl.expand_dims(gl.expand_dims(rstd, 1), 2)
        v4 = gl.reshape(v, [GB, NCHK, NQ, SUB])
        hi = v4.to(gl.bfloat16)
        if CPS == 2 * NQ:
            lo = (v4 - hi.to(gl.float32)).to(gl.bfloat16)
            op = gl.reshape(gl.permute(gl.join(hi, lo), (1, 0, 4, 2, 3)), [NCHK, GB * CPS, SUB])
        else:
            op = gl.reshape(gl.permute(hi, (1, 0, 2, 3)), [NCHK, GB * CPS, SUB])
        rows.slice(g0 * CPS, GB * CPS, dim=1).store(op)
    return gl.full([NBP], 1.0, gl.float32, gl.SliceLayout(1, gl.SliceLayout(2, l3)))


@gluon.jit
def _kpacked(xs, KP: gl.constexpr):
    """The staged operand as K-packed tiles read it (`_pair_rows_batch`'s KP): KP consecutive sub-chunks' [NBP CPS,
    64] blocks as one block of the same 128 B swizzle."""
    if KP > 1:
        xs = xs._reinterpret(gl.bfloat16, [xs.shape[0] // KP, KP * xs.shape[1], SUB], MMA_SMEM)
    return xs


@gluon.jit
def _tile_halves(t, ring, empty, acc, ep: gl.constexpr, NS: gl.constexpr, NBP: gl.constexpr, CPS: gl.constexpr,
                 KT: gl.constexpr, KP: gl.constexpr):
    """A tile slot sequence's products (acc, its last slot still held) as the slot's two halves in the layout `ep`
    ([GR / KP rows, NBP] each), the slot handed back (`_slot_exchange`)."""
    BOXES: gl.constexpr = ep.parent
    if CPS > 1:  # hi + lo
        acc = gl.sum(gl.reshape(acc, [2 * GR, KP, CPS, NBP]), axis=2)
    z = _slot_exchange(t, ring, empty, gl.reshape(acc, [2, GR, KP * NBP]), BOXES, NS, KT, KP)  # [half, row, seq]
    return _halves(z, ep)


@gluon.jit
def _halves(z, ep: gl.constexpr):
    """z ([2, rows, NBP] in `ep`'s parent) as its two halves."""
    BOXES: gl.constexpr = ep.parent
    half = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, BOXES))), 1), 2)
    return gl.sum(gl.where(half == 0, z, 0.0), axis=0), gl.sum(gl.where(half == 1, z, 0.0), axis=0)


@gluon.jit
def _pair_rows_batch(t, ring, ready, empty, xs, nkb, NS: gl.constexpr, NBP: gl.constexpr, CPS: gl.constexpr,
                     TILE: gl.constexpr, KT: gl.constexpr, ep: gl.constexpr, num_warps: gl.constexpr,
                     KP: gl.constexpr = 1):
    """A batch's products of one row group, one wgmma per ring slot for every sequence's column of the staged operand
    at once. Returns (t, y_a, y_b): the slot's two halves, [RG rows, NBP sequences] each in the layout `ep` (both
    halves' values of a row and sequence in one thread). With TILE a slot is `_issue_tile`'s [2 GR, 64] tile and
    every column of the product is used (N = CPS NBP: 1 or 2 per sequence). Otherwise it is two row-pair boxes of
    16 rows x BK (the batch-1 layout: row 4 i + q of a box is its row i over sub-chunk q), and a sequence's CPS
    columns are its 4 sub-chunks (times hi/lo): of each, the rows of its own sub-chunk count. With KP > 1 (TILE
    only) the slot is `_issue_tile`'s K-packed tiles: a half's GR / KP rows at KP sub-chunks a tile, multiplied by KP
    consecutive sub-chunks' operand at once (N = KP CPS NBP; the staged [NBP CPS, 64] blocks of consecutive
    sub-chunks are one [KP NBP CPS, 64] block of the same 128 B swizzle), and each row's sum taken over the KP
    diagonal blocks; the halves are then [GR / KP, NBP]."""
    # one wgmma as wide as the operand: with N 8 a wider product is several wgmmas, each reading the whole weight
    # tile from shared memory again (batch 16: twice; measured 3.8 % of the step, docs/perf-notes.md)
    accl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, KP * CPS * NBP, 16])
    # both layouts' slots are [128, 64] wgmma tiles (2 GR = 2 boxes x 16 rows x 4 sub-chunks)
    t, acc = _mma_slots(t, ring, ready, empty, _kpacked(xs, KP), nkb,
                        gl.zeros([2 * GR, KP * CPS * NBP], gl.float32, accl), NS, KT if TILE else 1, TILE)
    if TILE:
        y1, y2 = _tile_halves(t, ring, empty, acc, ep, NS, NBP, CPS, KT, KP)
    else:
        NQ: gl.constexpr = 2 * GR // (2 * BR)  # sub-chunks per box row
        rows = gl.arange(0, 2 * GR, layout=gl.SliceLayout(1, accl))
        cols = gl.arange(0, CPS * NBP, layout=gl.SliceLayout(0, accl))
        sel = gl.expand_dims(cols % NQ, 0) == gl.expand_dims(rows % NQ, 1)  # row 4 i + q meets sub-chunk q's columns
        z = gl.sum(gl.reshape(gl.where(sel, acc, 0.0), [2 * GR, NBP, CPS]), axis=2)  # [rows, NBP]: hi + lo
        BOXES: gl.constexpr = ep.parent
        y1, y2 = _halves(gl.convert_layout(gl.sum(gl.reshape(z, [2, BR, NQ, NBP]), axis=2), BOXES), ep)
    return t, y1, y2


@gluon.jit
def _staged_rows_batch(t, ring, ready, empty, vstage, src_ptr, sstride, nw_ptr, k0, k1, klo, nkb,
                       NORM: gl.constexpr, H: gl.constexpr, EPS: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr,
                       NB: gl.constexpr, NBP: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr, NS: gl.constexpr,
                       KT: gl.constexpr, ep: gl.constexpr, num_warps: gl.constexpr, tr, TRACE: gl.constexpr,
                       KP: gl.constexpr = 1):
    """A tile build's stage of its operand (`_stage_batch`: every sequence's src[k0:k1], zero below klo) and the
    products of its first row group (`_pair_rows_batch`) in one: the operand goes in groups of CG chunks, and a
    group's products (the slots of its K columns) are issued as soon as it is in shared memory, with the next group's
    loads in flight. Every SM of a phase stages the same activations at once, so the stage is the L2's broadcast of
    them (at batch 8, 64 KB of fp32 an SM), and staged whole it comes before any product. Measured faster where the
    build does not spill the next group's values (`StreamConfig.stage_groups`; which ops gain: docs/perf-notes.md).
    Returns (t, y_a, y_b, rstd), the last as `_stage_batch`'s."""
    accl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, KP * CPS * NBP, 16])  # `_pair_rows_batch`'s
    NG: gl.constexpr = (NCHK + CG - 1) // CG
    GS: gl.constexpr = CG * BK // (SUB * KT * KP)  # slots of a group's columns
    gl.static_assert(GS * SUB * KT * KP == CG * BK, "a stage group spans whole slots")
    ops = _tile_ops(vstage, NCHK, BK, NBP, CPS)
    xs = _kpacked(vstage, KP)
    acc = gl.zeros([2 * GR, KP * CPS * NBP], gl.float32, accl)
    v, w = _tile_load(src_ptr, sstride, nw_ptr, k0, k1, klo, 0, NORM, BK, NB, NBP, CG, num_warps)
    for g in gl.static_range(NG):
        if g == 0:
            ss = _tile_store(ops, v, w, 0, NORM, CG, CPS, NBP, BK)
        else:
            ss += _tile_store(ops, v, w, g * CG, NORM, CG, CPS, NBP, BK)
        fence_async_shared()
        gl.thread_barrier()
        if g + 1 < NG:
            v, w = _tile_load(src_ptr, sstride, nw_ptr, k0, k1, klo, (g + 1) * CG, NORM, BK, NB, NBP, CG, num_warps)
        elif TRACE:
            gl.store(tr + 6, ptx.gl_globaltimer())
        t, acc = _mma_slots(t, ring, ready, empty, xs, gl.minimum(nkb, (g + 1) * GS), acc, NS, KT, True,
                            gl.minimum(nkb, g * GS), g > 0)
    y1, y2 = _tile_halves(t, ring, empty, acc, ep, NS, NBP, CPS, KT, KP)
    return t, y1, y2, 1.0 / gl.sqrt(ss / H + EPS)


@gluon.jit
def _seq_scale(rs, ep: gl.constexpr):
    """[1, NBP] of `_stage_batch`'s per-sequence rstd, to scale an epilogue's [rows, NBP] values."""
    return gl.expand_dims(gl.convert_layout(rs, gl.SliceLayout(0, ep)), 0)


@gluon.jit
def _seq_rows(out_ptr, ostride, rows, y, a1, NB: gl.constexpr, RESIDUAL: gl.constexpr, ep: gl.constexpr):
    """out[b * ostride + rows] (+)= y[:, b] for every sequence b < NB and the rows below a1 (`_store_rows` per
    sequence)."""
    NBP: gl.constexpr = y.shape[1]
    bs = gl.expand_dims(gl.arange(0, NBP, layout=gl.SliceLayout(0, ep)), 0)
    ptrs = out_ptr + bs * ostride + gl.expand_dims(rows, 1)
    m = (gl.expand_dims(rows, 1) < a1) & (bs < NB)
    if RESIDUAL and out_ptr.dtype.element_ty != gl.float32:  # x in fp16 (`StreamConfig.x_dtype`): `ep` holds
        # row pairs (`_batch_op`)
        ptx.gl_red_add_f16x2(ptrs, y, m)
    elif RESIDUAL:
        gl.atomic_add(ptrs, y, mask=m, sem="relaxed", scope="gpu")
    else:  # logits in fp32; act in bf16 with `StreamConfig.act_bf16`
        gl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=m)


@gluon.jit
def _op_kpaired_batch(ring, ready, empty, vstage, t, src_ptr, sstride, nw_ptr, out_ptr, ostride, a0, a1, k0, k1,
                      NORM: gl.constexpr, RESIDUAL: gl.constexpr, H: gl.constexpr, EPS: gl.constexpr,
                      NS: gl.constexpr, NCHK: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr,
                      NBP: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr, KW: gl.constexpr, TILE: gl.constexpr,
                      KT: gl.constexpr, ep: gl.constexpr, num_warps: gl.constexpr, tr, TRACE: gl.constexpr,
                      SPIPE: gl.constexpr = False):
    """`_op_kpaired` for every sequence of a batch: o_proj and down (residual atomics into each sequence's x) and
    the LM head (each sequence's own final norm; plain stores into its logits). K goes in windows of at most KW (the
    staged chunks' width, the hidden size): a K span longer than that (down's) is staged and multiplied one window
    at a time, each window's products added into x (residual ops only: the LM head's K is the hidden size). Rows go
    2 RG at a time (`_load_k`'s slots)."""
    RG: gl.constexpr = GR if TILE else BR  # rows per half of a slot
    KS: gl.constexpr = SUB * KT if TILE else BK  # K per slot
    ir = gl.arange(0, RG, layout=gl.SliceLayout(1, ep))
    for w0 in range(k0 // SUB * SUB, k1, KW):  # `_load_k`'s windows
        w1 = gl.minimum(w0 + KW, k1)
        if SPIPE and NCHK > CG:  # the stage in groups, the first rows' products with it
            nkb = (w1 - w0 + KS - 1) // KS
            t, y1, y2, rs = _staged_rows_batch(t, ring, ready, empty, vstage, src_ptr, sstride, nw_ptr, w0, w1, k0,
                                               nkb, NORM, H, EPS, NCHK, BK, NB, NBP, CG, CPS, NS, KT, ep, num_warps,
                                               tr, TRACE)
            _kpaired_rows(out_ptr, ostride, a0, ir, y1, y2, rs, a1, NB, NORM and TILE, RESIDUAL, RG, ep)
            r0 = a0 + 2 * RG
        else:
            rs = _stage_batch(vstage, src_ptr, sstride, nw_ptr, w0, w1, k0, NORM, H, EPS, NCHK, BK, NB, NBP, CG,
                              CPS, TILE, num_warps, tr, TRACE)
            nkb = (w1 - w0 + KS - 1) // KS
            r0 = a0
        for r in range(r0, a1, 2 * RG):
            t, y1, y2 = _pair_rows_batch(t, ring, ready, empty, vstage, nkb, NS, NBP, CPS, TILE, KT, ep, num_warps)
            _kpaired_rows(out_ptr, ostride, r, ir, y1, y2, rs, a1, NB, NORM and TILE, RESIDUAL, RG, ep)
    return t


@gluon.jit
def _kpaired_rows(out_ptr, ostride, r, ir, y1, y2, rs, a1, NB: gl.constexpr, SCALE: gl.constexpr,
                  RESIDUAL: gl.constexpr, RG: gl.constexpr, ep: gl.constexpr):
    """`_op_kpaired_batch`'s epilogue of rows r .. r + 2 RG - 1 (the slot's halves y1, y2), scaled by each sequence's
    rstd with SCALE."""
    if SCALE:
        y1 = y1 * _seq_scale(rs, ep)
        y2 = y2 * _seq_scale(rs, ep)
    _seq_rows(out_ptr, ostride, r + ir, y1, a1, NB, RESIDUAL, ep)
    if r + RG < a1:
        _seq_rows(out_ptr, ostride, r + RG + ir, y2, a1, NB, RESIDUAL, ep)


@gluon.jit
def _op_gate_up_batch(ring, ready, empty, vstage, t, x_ptr, nw_ptr, act_ptr, layer, a0, a1, H: gl.constexpr,
                      IS: gl.constexpr, EPS: gl.constexpr, NS: gl.constexpr, NCHH: gl.constexpr,
                      BK: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr,
                      TILE: gl.constexpr, KT: gl.constexpr, ep: gl.constexpr, num_warps: gl.constexpr, tr,
                      TRACE: gl.constexpr, SPIPE: gl.constexpr = False):
    """`_op_gate_up` for every sequence of a batch (sequence b's act at b * IS), RG gate and up rows per slot."""
    RG: gl.constexpr = GR if TILE else BR
    KS: gl.constexpr = SUB * KT if TILE else BK
    ir = gl.arange(0, RG, layout=gl.SliceLayout(1, ep))
    nkb = (H + KS - 1) // KS
    r0 = a0
    if SPIPE and NCHH > CG:  # the stage in groups, the first rows' products with it
        t, g, u, rs = _staged_rows_batch(t, ring, ready, empty, vstage, x_ptr, H, nw_ptr + layer * H, a0 * 0,
                                         a0 * 0 + H, a0 * 0, nkb, True, H, EPS, NCHH, BK, NB, NBP, CG, CPS, NS, KT, ep,
                                         num_warps, tr, TRACE)
        _swiglu_rows(act_ptr, IS, a0 + ir, g, u, rs, a1, NB, TILE, ep)
        r0 = a0 + RG
    else:
        rs = _stage_batch(vstage, x_ptr, H, nw_ptr + layer * H, a0 * 0, a0 * 0 + H, a0 * 0, True, H, EPS, NCHH, BK,
                          NB, NBP, CG, CPS, TILE, num_warps, tr, TRACE)
    for r in range(r0, a1, RG):
        t, g, u = _pair_rows_batch(t, ring, ready, empty, vstage, nkb, NS, NBP, CPS, TILE, KT, ep, num_warps)
        _swiglu_rows(act_ptr, IS, r + ir, g, u, rs, a1, NB, TILE, ep)
    return t


@gluon.jit
def _swiglu_rows(act_ptr, IS: gl.constexpr, rows, g, u, rs, a1, NB: gl.constexpr, SCALE: gl.constexpr,
                 ep: gl.constexpr):
    """act[rows] of every sequence <- silu(gate) * up, both scaled by each sequence's rstd with SCALE."""
    if SCALE:
        g = g * _seq_scale(rs, ep)
        u = u * _seq_scale(rs, ep)
    _seq_rows(act_ptr, IS, rows, g / (1.0 + gl.exp(-g)) * u, a1, NB, False, ep)


@gluon.jit
def _op_qkv_batch(ring, ready, empty, vstage, t, x_ptr, nw_ptr, b_ptr, qkn_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr,
                  sin_ptr, rt_ptr, sq_ptr, knew_ptr, layer, a0, a1, H: gl.constexpr, NH: gl.constexpr,
                  NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr, EPS: gl.constexpr, QKV_BIAS: gl.constexpr,
                  NS: gl.constexpr, NCHH: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
                  CG: gl.constexpr, CPS: gl.constexpr, TILE: gl.constexpr, KT: gl.constexpr, ep: gl.constexpr,
                  num_warps: gl.constexpr, tr, TRACE: gl.constexpr, QKP: gl.constexpr = 1,
                  SPIPE: gl.constexpr = False, QK_NORM: gl.constexpr = False, SQ: gl.constexpr = False):
    """`_op_qkv` for every sequence of a batch: each sequence's rows rotated at its own position (rt[NB + b]), its q
    at b * q_size, its k/v in its own cache slot (layer * NB + b of the [L, B, nKV, S, hd] caches). A slot's halves
    are up to RG RoPE pairs' first and second rows (`_qkv_group`); with QKP > 1 (K-packed tiles, `_pair_rows_batch`)
    GR / QKP of them. With the QK-norm (whole-head q and k tiles on tile slots, not K-packed) a group is one whole
    head, which `_qkv_rows` normalises before the rotation. With SQ (attn_norm_qkv_rope_sq, any RoPE pairs) the
    norm is applied later: `_qkv_rows` writes each sequence's pairs unnormalised, with their sums of squares."""
    RG: gl.constexpr = GR // QKP if TILE else BR
    gl.static_assert(not QK_NORM or RG >= HD // 2, "a batch's QK-norm in QKV takes a head's pairs in one group")
    KS: gl.constexpr = SUB * KT * QKP if TILE else BK
    PIPE: gl.constexpr = SPIPE and NCHH > CG  # the stage in groups, the first pairs' products with it
    if not PIPE:
        rs = _stage_batch(vstage, x_ptr, H, nw_ptr + layer * H, a0 * 0, a0 * 0 + H, a0 * 0, True, H, EPS, NCHH, BK,
                          NB, NBP, CG, CPS, TILE, num_warps, tr, TRACE)
    ir = gl.arange(0, RG, layout=gl.SliceLayout(1, ep))
    bs = gl.expand_dims(gl.arange(0, NBP, layout=gl.SliceLayout(0, ep)), 0)  # [1, NBP]
    live = bs < NB
    pos = gl.load(rt_ptr + NB + bs, mask=live, other=0)
    slot = ((layer * NB + bs) * NKV).to(gl.int64)  # [1, NBP]: each sequence's cache slot of this layer
    p = a0 // 2
    pend = a1 // 2
    if PIPE:  # (the first pairs' loads issued before)
        head, n, jj, m, cs, sn, b1, b2 = _qkv_coefs(p, pend, ir, live, pos, b_ptr, cos_ptr, sin_ptr, layer, NH, NKV,
                                                    HD, QKV_BIAS, RG)
        t, y1, y2, rs = _staged_rows_batch(t, ring, ready, empty, vstage, x_ptr, H, nw_ptr + layer * H, a0 * 0,
                                           a0 * 0 + H, a0 * 0, (H + KS - 1) // KS, True, H, EPS, NCHH, BK, NB, NBP,
                                           CG, CPS, NS, KT, ep, num_warps, tr, TRACE, QKP)
        _qkv_rows(y1, y2, rs, head, jj, m, cs, sn, b1, b2, pos, slot, bs, q_ptr, kc_ptr, vc_ptr, qkn_ptr, sq_ptr,
                  knew_ptr, layer, NH, NKV, HD, S, EPS, QKV_BIAS, TILE, QK_NORM, SQ, ep)
        p += n
    while p < pend:
        head, n, jj, m, cs, sn, b1, b2 = _qkv_coefs(p, pend, ir, live, pos, b_ptr, cos_ptr, sin_ptr, layer, NH, NKV,
                                                    HD, QKV_BIAS, RG)
        t, y1, y2 = _pair_rows_batch(t, ring, ready, empty, vstage, (H + KS - 1) // KS, NS, NBP, CPS, TILE, KT,
                                     ep, num_warps, QKP)
        _qkv_rows(y1, y2, rs, head, jj, m, cs, sn, b1, b2, pos, slot, bs, q_ptr, kc_ptr, vc_ptr, qkn_ptr, sq_ptr,
                  knew_ptr, layer, NH, NKV, HD, S, EPS, QKV_BIAS, TILE, QK_NORM, SQ, ep)
        p += n
    return t


@gluon.jit
def _qkv_coefs(p, pend, ir, live, pos, b_ptr, cos_ptr, sin_ptr, layer, NH: gl.constexpr, NKV: gl.constexpr,
               HD: gl.constexpr, QKV_BIAS: gl.constexpr, RG: gl.constexpr):
    """What `_qkv_rows` needs of the RoPE pairs from p (`_qkv_group`), loaded before their products so that the
    loads are in flight meanwhile: (head, pairs, column [RG, 1], mask [RG, NBP], cos, sin, the two biases)."""
    HALF: gl.constexpr = HD // 2
    head, j, n = _qkv_group(p, pend, HALF, RG)
    jj = gl.expand_dims(j + ir, 1)  # [RG, 1]
    m = gl.expand_dims(ir < n, 1) & live
    b1 = 0.0
    b2 = 0.0
    if QKV_BIAS:
        bias = b_ptr + layer * ((NH + 2 * NKV) * HD) + head * HD + jj
        b1 = gl.load(bias, mask=m, other=0.0)
        b2 = gl.load(bias + HALF, mask=m, other=0.0)
    rot = m & (head < NH + NKV)
    cs = gl.load(cos_ptr + pos * HALF + jj, mask=rot, other=0.0)
    sn = gl.load(sin_ptr + pos * HALF + jj, mask=rot, other=0.0)
    return head, n, jj, m, cs, sn, b1, b2


@gluon.jit
def _qkv_rows(y1, y2, rs, head, jj, m, cs, sn, b1, b2, pos, slot, bs, q_ptr, kc_ptr, vc_ptr, qkn_ptr, sq_ptr,
              knew_ptr, layer, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr,
              EPS: gl.constexpr, QKV_BIAS: gl.constexpr, SCALE: gl.constexpr, QK_NORM: gl.constexpr,
              SQ: gl.constexpr, ep: gl.constexpr):
    """`_op_qkv_batch`'s epilogue of one group of RoPE pairs (`_qkv_coefs`): the halves y1, y2 scaled by each
    sequence's rstd with SCALE, biased, with QK_NORM (the group a whole q or k head) each sequence's head times
    rsqrt(mean(y^2) + eps) and the layer's q_norm or k_norm, rotated at each sequence's position into its q, or its
    cache slot's K; V as it is. With SQ (the norm applied later, as `_op_qkv`'s SQ) each q and k pair's sum of squares
    goes to the sequence's `qk_sq`, the pair times its norm weight is rotated, and k goes to the sequence's `k_new`
    instead of the cache."""
    HALF: gl.constexpr = HD // 2
    if SCALE:
        y1 = y1 * _seq_scale(rs, ep)
        y2 = y2 * _seq_scale(rs, ep)
    if QKV_BIAS:
        y1 = y1 + b1
        y2 = y2 + b2
    if QK_NORM:
        if head < NH + NKV:  # the rows past the head's (m false) hold other rows' products: left out of the sum
            ss = gl.sum(gl.where(m, y1 * y1 + y2 * y2, 0.0), axis=0)  # [NBP] per sequence
            inv = gl.expand_dims(1.0 / gl.sqrt(ss / HD + EPS), 0)
            nrm = qkn_ptr + layer * (2 * HD) + (head >= NH).to(gl.int32) * HD + jj  # [RG, 1]
            half = jj < HALF
            y1 = y1 * inv * gl.load(nrm, mask=half, other=0.0)
            y2 = y2 * inv * gl.load(nrm + HALF, mask=half, other=0.0)
    if SQ:
        if head < NH + NKV:
            gl.store(sq_ptr + bs * ((NH + NKV) * HALF) + head * HALF + jj, y1 * y1 + y2 * y2, mask=m)
            nrm = qkn_ptr + layer * (2 * HD) + (head >= NH).to(gl.int32) * HD + jj  # [RG, 1]
            half = jj < HALF
            y1 = y1 * gl.load(nrm, mask=half, other=0.0)
            y2 = y2 * gl.load(nrm + HALF, mask=half, other=0.0)
    if head < NH + NKV:
        o1 = y1 * cs - y2 * sn
        o2 = y2 * cs + y1 * sn
        if head < NH:
            qb = q_ptr + bs * (NH * HD) + head * HD + jj
            gl.store(qb, o1, mask=m)
            gl.store(qb + HALF, o2, mask=m)
        elif SQ:
            kb = knew_ptr + bs * (NKV * HD) + (head - NH) * HD + jj
            gl.store(kb, o1, mask=m)
            gl.store(kb + HALF, o2, mask=m)
        else:
            cb = kc_ptr + ((slot + head - NH) * S + pos) * HD + jj
            gl.store(cb, o1.to(gl.bfloat16), mask=m)
            gl.store(cb + HALF, o2.to(gl.bfloat16), mask=m)
    else:
        cb = vc_ptr + ((slot + head - NH - NKV) * S + pos) * HD + jj
        gl.store(cb, y1.to(gl.bfloat16), mask=m)
        gl.store(cb + HALF, y2.to(gl.bfloat16), mask=m)


@gluon.jit
def _batch_op(op, layer, a0, a1, a2, a3, a4, t, ring, ready, empty, vstage, rt_ptr, embed_ptr, attn_norm_ptr,
              mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr,
              attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr, qk_sq_ptr, k_new_ptr, seq_splits,
              H: gl.constexpr, IS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
              S: gl.constexpr, V: gl.constexpr, EPS: gl.constexpr, SCALE: gl.constexpr, G: gl.constexpr,
              GP: gl.constexpr, QKV_BIAS: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr, NCHH: gl.constexpr,
              NCHQ: gl.constexpr, NCHI: gl.constexpr, BK: gl.constexpr, BTK: gl.constexpr, KV_RING: gl.constexpr,
              ATTN_EXP2: gl.constexpr, SP: gl.constexpr, BE: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
              CG: gl.constexpr, CPS: gl.constexpr, TILE: gl.constexpr, KT: gl.constexpr, num_warps: gl.constexpr, tr,
              TRACE: gl.constexpr, QKP: gl.constexpr, SPIPE: gl.constexpr, QK_NORM: gl.constexpr,
              QKH: gl.constexpr):
    """One instruction of a batched schedule. Weight ops serve every sequence (each weight tile streamed once, one
    wgmma per slot for all of them); attention and attn_reduce serve sequence a3 (`seq`): its q, its cache slot, its
    position rt[NB + seq], its split partials at seq * seq_splits (the schedule's largest split count) rows of the
    partial buffers, as the catalogue's footprints place them. attn_reduce_o_proj runs with one split only: its
    merge is then o_proj's staging of the partials.

    A QK-norm model's QKV normalises whole heads where the build's QKV tiles are heads (QKH); on RoPE-pair tiles
    (`StreamConfig.qk_pairs`) QKV writes each sequence's unnormalised pairs and their sums of squares
    (attn_norm_qkv_rope_sq), and the norm comes in qk_norm_apply (every sequence's KV head a0) or in attention (a4:
    qk_norm), each reading sequence b's `qk_sq` and `k_new` at b times one sequence's part. A build has the code of
    one of the two only (`pack.check_runs_batched_on_v10` refuses the other's ops)."""
    # a slot's two halves ([2, rows, NBP sequences]) with both halves' values of a row and sequence in one thread
    # (`_pair_rows_batch`); `ep` is one half. With x in fp16 (`StreamConfig.x_dtype`, tile slots) a thread holds
    # two adjacent rows of a sequence, which o_proj and down add into x as one 32-bit reduction (`_seq_rows`)
    X16: gl.constexpr = x_ptr.dtype.element_ty != gl.float32
    gl.static_assert(not X16 or (TILE and GR == 64 and NBP >= num_warps), "fp16 x: tile slots, a sequence a warp")
    RP: gl.constexpr = 2 if X16 else 1  # a sequence's rows a thread holds
    ep: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([2, RP, 1], [1, 32, 1], [1, GR // (32 * RP),
                                                                                    num_warps * 32 * RP // GR],
                                                          [2, 1, 0]) if TILE else
                                      gl.BlockedLayout([2, 1, 1], [1, BR, 32 // BR], [1, 1, num_warps], [2, 1, 0]))
    # QKV's one form in this build: with the QK-norm on RoPE-pair tiles attn_norm_qkv_rope_sq (`pack` refuses the
    # other), else attn_norm_qkv_rope
    SQ: gl.constexpr = QK_NORM and not QKH
    if op == OP_EMBED:
        _op_embed_batch(embed_ptr, x_ptr, rt_ptr, a0, a1, H, BE, NB, NBP, num_warps)
    elif op == (OP_QKV_SQ if SQ else OP_QKV):
        t = _op_qkv_batch(ring, ready, empty, vstage, t, x_ptr, attn_norm_ptr, bqkv_ptr, qk_norm_ptr, q_ptr, kc_ptr,
                          vc_ptr, cos_ptr, sin_ptr, rt_ptr, qk_sq_ptr, k_new_ptr, layer, a0, a1, H, NH, NKV, HD, S,
                          EPS, QKV_BIAS, NS, NCHH, BK, NB, NBP, CG, CPS, TILE, KT, ep, num_warps, tr, TRACE, QKP,
                          SPIPE, QKH, SQ)
    elif op == OP_PARTIAL:
        t = _op_attn_partial(q_ptr + a3 * (NH * HD), kc_ptr, vc_ptr, opart_ptr + a3 * seq_splits * (NH * HD),
                             lse_ptr + a3 * seq_splits * NH, qk_sq_ptr + a3 * ((NH + NKV) * (HD // 2)),
                             k_new_ptr + a3 * (NKV * HD), layer * NB + a3, a0, a1, a2, gl.load(rt_ptr + NB + a3),
                             a4, t, ring, ready, empty, vstage, NH, NKV, HD, S, G, GP, SCALE, EPS, SQ, NS,
                             SB * KT, BTK, KV_RING, ATTN_EXP2, num_warps, tr, TRACE)
    elif op == OP_REDUCE:
        _op_attn_reduce(opart_ptr + a3 * seq_splits * (NH * HD), lse_ptr + a3 * seq_splits * NH,
                        attn_ptr + a3 * (NH * HD), a0, a1, a2, NH, HD, GP, SP, num_warps)
    elif op == OP_OPROJ:
        t = _op_kpaired_batch(ring, ready, empty, vstage, t, attn_ptr, NH * HD, attn_ptr, x_ptr, H, a0, a1, a2, a3,
                              False, True, H, EPS, NS, NCHQ, BK, NB, NBP, CG, CPS, NCHH * BK, TILE, KT, ep,
                              num_warps, tr, TRACE, SPIPE)
    elif op == OP_FUSED:  # with one attention split (`pack.check_runs_batched_on_v10`) the merge is the identity:
        # o_proj stages each sequence's attention output from its only split's partial (fp32, normalised)
        t = _op_kpaired_batch(ring, ready, empty, vstage, t, opart_ptr, NH * HD, opart_ptr, x_ptr, H, a0, a1, a2, a3,
                              False, True, H, EPS, NS, NCHQ, BK, NB, NBP, CG, CPS, NCHH * BK, TILE, KT, ep,
                              num_warps, tr, TRACE, SPIPE)
    elif op == OP_GATE_UP:
        t = _op_gate_up_batch(ring, ready, empty, vstage, t, x_ptr, mlp_norm_ptr, act_ptr, layer, a0, a1, H, IS, EPS,
                              NS, NCHH, BK, NB, NBP, CG, CPS, TILE, KT, ep, num_warps, tr, TRACE, SPIPE)
    elif op == OP_DOWN:
        t = _op_kpaired_batch(ring, ready, empty, vstage, t, act_ptr, IS, act_ptr, x_ptr, H, a0, a1, a2, a3, False,
                              True, H, EPS, NS, NCHI, BK, NB, NBP, CG, CPS, NCHH * BK, TILE, KT, ep, num_warps, tr,
                              TRACE, SPIPE)
    elif op == OP_LM_HEAD:
        t = _op_kpaired_batch(ring, ready, empty, vstage, t, x_ptr, H, final_norm_ptr, logits_ptr, V, a0, a1, a0 * 0,
                              a0 * 0 + H, True, False, H, EPS, NS, NCHH, BK, NB, NBP, CG, CPS, NCHH * BK, TILE, KT, ep,
                              num_warps, tr, TRACE, SPIPE)
    elif SQ and op == OP_QK_APPLY:  # the QK-norm applied apart: compiled where QKV is attn_norm_qkv_rope_sq
        _op_qk_apply(q_ptr, qk_sq_ptr, k_new_ptr, kc_ptr, rt_ptr + NB, layer, a0, a1, 0, NB, NBP, NH, NKV, HD, S,
                     EPS, G, GP, num_warps)
    return t


@gluon.jit
def _single_op(op, layer, a0, a1, a2, a3, a4, token, pos, t, ring, ready, empty, vbuf, vstage, embed_ptr,
               attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr, vc_ptr,
               opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr, qk_sq_ptr, k_new_ptr,
               H: gl.constexpr, IS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
               S: gl.constexpr, EPS: gl.constexpr, SCALE: gl.constexpr, G: gl.constexpr, GP: gl.constexpr,
               QKV_BIAS: gl.constexpr, QK_NORM: gl.constexpr, QG: gl.constexpr, NS: gl.constexpr, SB: gl.constexpr,
               NCHH: gl.constexpr, NCHQ: gl.constexpr, NCHI: gl.constexpr, BK: gl.constexpr, BTK: gl.constexpr,
               KV_RING: gl.constexpr, ATTN_EXP2: gl.constexpr, ATTN_CALL: gl.constexpr, SP: gl.constexpr,
               MB: gl.constexpr, BE: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr, tr,
               TRACE: gl.constexpr, KW: gl.constexpr, KA: gl.constexpr):
    """One instruction of a batch-1 schedule: the op `op` with its row's arguments. KA: what o_proj's and down's K
    ranges start and end at multiples of (`StreamConfig.k_vec`; the schedule is checked when it is packed), so that
    their staging loads go as 16-byte vectors."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    if op == OP_EMBED:
        _op_embed(embed_ptr, x_ptr, token, a0, a1, H, BE, num_warps)
    elif op == OP_QKV:
        t = _op_qkv(ring, ready, empty, vbuf, vstage, t, x_ptr, attn_norm_ptr, bqkv_ptr, qk_norm_ptr, q_ptr,
                    kc_ptr, vc_ptr, cos_ptr, sin_ptr, qk_sq_ptr, k_new_ptr, layer, a0, a1, pos, H, NH, NKV, HD, S,
                    EPS, QKV_BIAS, QK_NORM, False, QG, NS, SB, NCHH, BK, blk, MMA, num_warps, tr, TRACE)
    elif op == OP_PARTIAL:
        if ATTN_CALL:  # a function of its own (`StreamConfig.attn_call`)
            t = _attn_partial_call(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, qk_sq_ptr, k_new_ptr, layer, a0, a1,
                                   a2, pos, a4, t, ring, ready, empty, vstage, NH, NKV, HD, S, G, GP, SCALE, EPS,
                                   QK_NORM, NS, SB, BTK, KV_RING, ATTN_EXP2, num_warps)
        else:
            t = _op_attn_partial(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, qk_sq_ptr, k_new_ptr, layer, a0, a1, a2,
                                 pos, a4, t, ring, ready, empty, vstage, NH, NKV, HD, S, G, GP, SCALE, EPS, QK_NORM,
                                 NS, SB, BTK, KV_RING, ATTN_EXP2, num_warps, tr, TRACE)
    elif op == OP_REDUCE:
        _op_attn_reduce(opart_ptr, lse_ptr, attn_ptr, a0, a1, a2, NH, HD, GP, SP, num_warps)
    elif op == OP_OPROJ:
        t = _op_kpaired(ring, ready, empty, vbuf, vstage, t, attn_ptr, attn_ptr, x_ptr, a0, a1, a2 // KA * KA,
                        a3 // KA * KA, False, True, H, EPS, NS, SB, NCHQ, BK, blk, MMA, num_warps, tr, TRACE)
    elif op == OP_FUSED:
        t = _op_reduce_oproj(ring, ready, empty, vbuf, vstage, t, opart_ptr, lse_ptr, x_ptr, a0, a1, a2, a3, a4,
                             NH, HD, NS, SB, NCHQ, BK, SP, MB, blk, MMA, num_warps, tr, TRACE)
    elif op == OP_GATE_UP:
        t = _op_gate_up(ring, ready, empty, vbuf, vstage, t, x_ptr, mlp_norm_ptr, act_ptr, layer, a0, a1, H, EPS,
                        NS, SB, NCHH, BK, blk, MMA, num_warps, tr, TRACE)
    elif op == OP_DOWN:
        t = _op_kpaired(ring, ready, empty, vbuf, vstage, t, act_ptr, act_ptr, x_ptr, a0, a1, a2 // KA * KA,
                        a3 // KA * KA, False, True, H, EPS, NS, SB, NCHI, BK, blk, MMA, num_warps, tr, TRACE, KW)
    elif op == OP_LM_HEAD:
        t = _op_kpaired(ring, ready, empty, vbuf, vstage, t, x_ptr, final_norm_ptr, logits_ptr, a0, a1, a0 * 0,
                        a0 * 0 + H, True, False, H, EPS, NS, SB, NCHH, BK, blk, MMA, num_warps, tr, TRACE)
    # QK-norm applied apart from QKV: compiled into QK_NORM builds only (the Llama build has neither branch)
    elif QK_NORM and op == OP_QKV_SQ:
        t = _op_qkv(ring, ready, empty, vbuf, vstage, t, x_ptr, attn_norm_ptr, bqkv_ptr, qk_norm_ptr, q_ptr,
                    kc_ptr, vc_ptr, cos_ptr, sin_ptr, qk_sq_ptr, k_new_ptr, layer, a0, a1, pos, H, NH, NKV, HD, S,
                    EPS, QKV_BIAS, False, True, QG, NS, SB, NCHH, BK, blk, MMA, num_warps, tr, TRACE)
    elif QK_NORM and op == OP_QK_APPLY:
        _op_qk_apply(q_ptr, qk_sq_ptr, k_new_ptr, kc_ptr, qk_sq_ptr, layer, a0, a1, pos, 1, 1, NH, NKV, HD, S, EPS,
                     G, GP, num_warps)
    return t


@gluon.jit
def _wait(counters_ptr, waits_ptr, err_ptr, pid, iid, woff, wn, c0, v0, ok, timeout_ns, WB: gl.constexpr,
          num_warps: gl.constexpr):
    """Spin until every wait of the instruction holds; on a timeout (or another worker's abort) report and return 0,
    after which the worker no longer waits. Only the first warp polls (one request per poll round and SM on a counter
    every worker of a stage polls, instead of one per warp: those queue at the counter's L2 slice and delay the
    hops between stages, docs/perf-notes.md) and the others wait at a CTA barrier; the first warp's `ok` is then the
    one that matters (the others never poll)."""
    if ok != 0:
        if wn == 1:
            cur = ptx.gl_load_acquire_lead(counters_ptr + c0)
            if cur < v0:
                t0 = ptx.gl_globaltimer()
                elapsed = t0 - t0
                abort = pid * 0
                while (cur < v0) & (elapsed < timeout_ns) & (abort == 0):
                    # the abort flag's load goes first: the acquire holds back every later load
                    abort = gl.load(err_ptr + ABORT, mask=elapsed >= ABORT_AFTER_NS, other=0, cache_modifier=".cg")
                    cur = ptx.gl_load_acquire_lead(counters_ptr + c0)
                    elapsed = ptx.gl_globaltimer() - t0
                if cur < v0:
                    _report_stuck(err_ptr, pid, iid, c0, cur, v0)
                    ok = pid * 0
        elif wn > 1:
            lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            wb = woff * 0
            while (wb < wn) & (ok != 0):
                lanes = wb + gl.arange(0, WB, layout=lay)
                lm = lanes < wn
                cs = gl.load(waits_ptr + 2 * (woff + lanes), mask=lm, other=0)
                nd = gl.load(waits_ptr + 2 * (woff + lanes) + 1, mask=lm, other=0)
                curs = ptx.gl_load_acquire_lead(counters_ptr + cs)
                short = gl.sum((curs < nd).to(gl.int32), axis=0)
                if short > 0:
                    t0 = ptx.gl_globaltimer()
                    elapsed = t0 - t0
                    abort = pid * 0
                    while (short > 0) & (elapsed < timeout_ns) & (abort == 0):
                        abort = gl.load(err_ptr + ABORT, mask=elapsed >= ABORT_AFTER_NS, other=0,
                                        cache_modifier=".cg")
                        curs = ptx.gl_load_acquire_lead(counters_ptr + cs)
                        short = gl.sum((curs < nd).to(gl.int32), axis=0)
                        elapsed = ptx.gl_globaltimer() - t0
                    if short > 0:
                        bad = gl.min(gl.where(curs < nd, lanes, wn), axis=0)
                        sel = lanes == bad
                        _report_stuck(err_ptr, pid, iid, gl.sum(gl.where(sel, cs, 0), axis=0),
                                      gl.sum(gl.where(sel, curs, 0), axis=0), gl.sum(gl.where(sel, nd, 0), axis=0))
                        ok = pid * 0
                wb += WB
    # outside `ok != 0`: after a timeout only the first warp's ok is 0, and every warp must reach the barrier
    if wn > 0:
        gl.thread_barrier()  # the other warps' reads come after the first warp's acquires
    return ok


#: `_single_op` as a function of its own (`StreamConfig.op_call`)
_single_op_call = gluon.jit(noinline=True)(_single_op.fn)


@gluon.jit
def _compute(ins_ptr, waits_ptr, sigs_ptr, qoff_ptr, counters_ptr, err_ptr, trace_ptr, smid_ptr, rt_ptr,
             embed_ptr, attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr,
             x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr,
             qk_sq_ptr, k_new_ptr, timeout_ns, seq_splits, ring, ready, empty, vbuf, vstage,
             H: gl.constexpr, IS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
             S: gl.constexpr, V: gl.constexpr, EPS: gl.constexpr, SCALE: gl.constexpr, G: gl.constexpr,
             GP: gl.constexpr, QKV_BIAS: gl.constexpr, QK_NORM: gl.constexpr, QG: gl.constexpr, NS: gl.constexpr,
             SB: gl.constexpr, NCHH: gl.constexpr, NCHQ: gl.constexpr, NCHI: gl.constexpr,
             BK: gl.constexpr, BTK: gl.constexpr, KV_RING: gl.constexpr, ATTN_EXP2: gl.constexpr,
             ATTN_CALL: gl.constexpr, OP_CALL: gl.constexpr, TRACE: gl.constexpr, ROWW: gl.constexpr,
             WB: gl.constexpr, SP: gl.constexpr,
             MB: gl.constexpr, BE: gl.constexpr,
             MMA: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr,
             TILE: gl.constexpr, KT: gl.constexpr, KW: gl.constexpr, KA: gl.constexpr, num_warps: gl.constexpr,
             QKP: gl.constexpr, QKH: gl.constexpr, SPIPE: gl.constexpr):
    """The compute partition: waits, ops, signals, for every instruction of this worker's queue in order (its ops:
    `_single_op`, a batch's `_batch_op`)."""
    pid = gl.program_id(0)
    gl.store(smid_ptr + pid, ptx.gl_smid())
    qi = gl.load(qoff_ptr + pid)
    q1 = gl.load(qoff_ptr + pid + 1)
    token = gl.load(rt_ptr)
    pos = gl.load(rt_ptr + 1)
    ok = pid * 0 + 1
    t = pid * 0
    (op, layer, a0, a1, a2, a3, iid, woff, wn, soff, sn, c0, v0, sc0, sa0, idx, a4) = _row17(
        ins_ptr, gl.maximum(gl.minimum(qi, q1 - 1), 0), ROWW)
    while qi < q1:
        # the next row is read one instruction ahead: its latency hides behind this instruction
        (n_op, n_layer, n_a0, n_a1, n_a2, n_a3, n_iid, n_woff, n_wn, n_soff, n_sn, n_c0, n_v0, n_sc0, n_sa0,
         n_idx, n_a4) = _row17(ins_ptr, gl.maximum(gl.minimum(qi + 1, q1 - 1), 0), ROWW)
        tr = trace_ptr + idx.to(gl.int64) * TRACE_W  # this instruction's trace row (used when TRACE)
        if TRACE:
            t_wait = ptx.gl_globaltimer()
        ok = _wait(counters_ptr, waits_ptr, err_ptr, pid, iid, woff, wn, c0, v0, ok, timeout_ns, WB, num_warps)
        if TRACE:
            t_start = ptx.gl_globaltimer()
        if NB > 1:
            t = _batch_op(op, layer, a0, a1, a2, a3, a4, t, ring, ready, empty, vstage, rt_ptr, embed_ptr,
                          attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr,
                          vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr, qk_sq_ptr,
                          k_new_ptr, seq_splits, H, IS, NH, NKV, HD, S, V, EPS, SCALE, G, GP, QKV_BIAS, NS, SB, NCHH,
                          NCHQ, NCHI, BK, BTK, KV_RING, ATTN_EXP2, SP, BE, NB, NBP, CG, CPS, TILE, KT, num_warps, tr,
                          TRACE, QKP, SPIPE, QK_NORM, QKH)
        elif OP_CALL:  # the op a function of its own (`StreamConfig.op_call`)
            t = _single_op_call(op, layer, a0, a1, a2, a3, a4, token, pos, t, ring, ready, empty, vbuf, vstage,
                                embed_ptr, attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, x_ptr,
                                q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr,
                                sin_ptr, qk_sq_ptr, k_new_ptr, H, IS, NH, NKV, HD, S, EPS, SCALE, G, GP, QKV_BIAS,
                                QK_NORM, QG, NS, SB, NCHH, NCHQ, NCHI, BK, BTK, KV_RING, ATTN_EXP2, ATTN_CALL, SP, MB,
                                BE, MMA, num_warps, tr, TRACE, KW, KA)
        else:
            t = _single_op(op, layer, a0, a1, a2, a3, a4, token, pos, t, ring, ready, empty, vbuf, vstage, embed_ptr,
                           attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr,
                           vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr, qk_sq_ptr,
                           k_new_ptr, H, IS, NH, NKV, HD, S, EPS, SCALE, G, GP, QKV_BIAS, QK_NORM, QG, NS, SB, NCHH,
                           NCHQ, NCHI, BK, BTK, KV_RING, ATTN_EXP2, ATTN_CALL, SP, MB, BE, MMA, num_warps, tr, TRACE,
                           KW, KA)
        gl.thread_barrier()
        if TRACE:
            gl.store(tr + 7, ptx.gl_globaltimer())  # the op's end, before its signals
        si = soff * 0
        while si < sn:
            sc = sc0
            sa = sa0
            if si > 0:
                sc = gl.load(sigs_ptr + 2 * (soff + si))
                sa = gl.load(sigs_ptr + 2 * (soff + si) + 1)
            ptx.gl_signal_release(counters_ptr + sc, sa)
            si += 1
        if TRACE:
            t_end = ptx.gl_globaltimer()
            gl.store(tr, t_wait)
            gl.store(tr + 1, t_start)
            gl.store(tr + 2, t_end)
            gl.store(tr + 3, pid.to(gl.int64))
        qi += 1
        (op, layer, a0, a1, a2, a3, iid, woff, wn, soff, sn, c0, v0, sc0, sa0, idx, a4) = (
            n_op, n_layer, n_a0, n_a1, n_a2, n_a3, n_iid, n_woff, n_wn, n_soff, n_sn, n_c0, n_v0, n_sc0, n_sa0, n_idx,
            n_a4)


@gluon.jit
def stream_megakernel(
    ins_ptr, waits_ptr, sigs_ptr, qoff_ptr, counters_ptr, err_ptr, trace_ptr, smid_ptr, rt_ptr,
    embed_ptr, attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr, d_qkv, d_o, d_g, d_u, d_d, d_lm,
    d_k, d_v, wqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, lm_head_ptr,
    x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr,
    qk_sq_ptr, k_new_ptr, timeout_ns, seq_splits,
    H: gl.constexpr, IS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr, S: gl.constexpr,
    V: gl.constexpr, EPS: gl.constexpr, SCALE: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, QKV_BIAS: gl.constexpr,
    QK_NORM: gl.constexpr, QG: gl.constexpr, NS: gl.constexpr, INFLIGHT: gl.constexpr, QIN: gl.constexpr,
    SB: gl.constexpr,
    NCH: gl.constexpr, NCHH: gl.constexpr, NCHQ: gl.constexpr, NCHI: gl.constexpr, BK: gl.constexpr,
    BTK: gl.constexpr, KV_RING: gl.constexpr, ATTN_EXP2: gl.constexpr, ATTN_CALL: gl.constexpr,
    OP_CALL: gl.constexpr, TRACE: gl.constexpr, ROWW: gl.constexpr,
    WB: gl.constexpr, SP: gl.constexpr, MB: gl.constexpr, BE: gl.constexpr, LOADER_REGS: gl.constexpr,
    MMA: gl.constexpr,
    NB: gl.constexpr, NBP: gl.constexpr, CG: gl.constexpr, CPS: gl.constexpr, KW: gl.constexpr, TILE: gl.constexpr,
    XR: gl.constexpr, QXR: gl.constexpr, KT: gl.constexpr, KA: gl.constexpr, NL: gl.constexpr, CPF: gl.constexpr,
    QKP: gl.constexpr, QKH: gl.constexpr, SPIPE: gl.constexpr, GIN: gl.constexpr, num_warps: gl.constexpr,
):
    if MMA:  # boxes are [16 * BK / 64, 64] wgmma tiles (the descriptors' [16, 64] boxes stacked)
        ring = gl.allocate_shared_memory(gl.bfloat16, [SB * NS * KT, BR * BK // SUB, SUB], MMA_SMEM)
    else:
        ring = gl.allocate_shared_memory(gl.bfloat16, [SB * NS, BR, BK], d_qkv.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    # The staged activation vector, NCH chunks of BK fp32: written whole through a 2-D view (vstage), read a chunk
    # at a time through a view with a 1-D layout (vbuf); both unswizzled row-major, so the same bytes.
    # On the tensor-core path it holds the same bytes as `_store_operand`'s bf16 hi/lo operand (vbuf unused).
    # A batch's operand has every sequence's rows per 64-column sub-chunk (`_stage_batch`).
    if TILE:  # per 64-column sub-chunk of K, CPS rows per sequence (`_stage_batch`)
        vstage = gl.allocate_shared_memory(gl.bfloat16, [NCH * (BK // SUB), NBP * CPS, SUB], MMA_SMEM)
        vbuf = vstage
    elif MMA:
        vstage = gl.allocate_shared_memory(gl.bfloat16, [NCH, NBP * CPS, SUB], MMA_SMEM)
        vbuf = vstage
    else:
        vstage = gl.allocate_shared_memory(gl.float32, [NCH, BK],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        vbuf = vstage._reinterpret(gl.float32, [NCH, BK],
                                   gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=32 if CPF else 1)  # with CPF each loader thread's copies arrive
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_compute, (ins_ptr, waits_ptr, sigs_ptr, qoff_ptr, counters_ptr, err_ptr, trace_ptr, smid_ptr, rt_ptr,
                    embed_ptr, attn_norm_ptr, mlp_norm_ptr, final_norm_ptr, bqkv_ptr, qk_norm_ptr,
                    x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr,
                    sin_ptr, qk_sq_ptr, k_new_ptr, timeout_ns, seq_splits, ring, ready, empty, vbuf, vstage, H, IS,
                    NH, NKV, HD, S, V, EPS, SCALE, G, GP,
                    QKV_BIAS, QK_NORM, QG, NS, SB, NCHH, NCHQ, NCHI, BK, BTK, KV_RING, ATTN_EXP2, ATTN_CALL, OP_CALL,
                    TRACE, ROWW, WB, SP, MB, BE, MMA, NB, NBP, CG, CPS, TILE, KT, KW, KA, num_warps, QKP, QKH,
                    SPIPE)),
        (_loader, (ins_ptr, qoff_ptr, rt_ptr, trace_ptr, d_qkv, d_o, d_g, d_u, d_d, d_lm, d_k, d_v, wqkv_ptr, wo_ptr,
                   wg_ptr, wu_ptr, wd_ptr, lm_head_ptr, kc_ptr, vc_ptr, ring, ready, empty, H, IS, NH, NKV, HD, S,
                   QK_NORM, ROWW, NS, INFLIGHT, QIN, SB, BK, BTK, KV_RING, MMA, TRACE, NB, KW, TILE, XR, QXR, KT, NL, V,
                   CPF, QKP, GIN)),
    ], [1], [LOADER_REGS])


# -- host side ---------------------------------------------------------------------------------------------------

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
#: mbarriers and the compiler's scratch: the compiled kernels use 0.3-0.4 KB beyond the ring and the staging buffer
#: (scripts/compile_check.py); a larger reserve would cost a ring slot
SMEM_RESERVE = 2 * 1024
#: Registers of the loader warp at least where a batch streams tiles: `_issue_tile`'s row groups spill at 32
TILE_LOADER_REGS = 40
CP_LOADER_REGS = 96  # cp.async fills hold a box's copy addresses: 464 B of spill stack at 32 registers, 24 at 64
#: the fewest 32 KB tile slots (`StreamConfig.tile_k` 128) a ring may have; with fewer, tiles take 16 KB slots
MIN_TILE_SLOTS = 4


def _named_barrier_stage(backend: Any, stages: dict[str, Any], options: Any, language: Any, capability: Any,
                         prev: Any = None) -> None:
    """Triton's stage hook (`triton.knobs.runtime.add_stages_inspection_hook`): the megakernel's PTX gets its called
    functions' CTA barriers named for the compute partition (`ptx.partition_barriers`); other kernels pass as they
    are."""
    if prev is not None:
        prev(backend, stages, options, language, capability)
    make_ptx = stages.get("ptx")
    if make_ptx is None:
        return

    def ptx_stage(src: Any, metadata: Any) -> str:
        text = make_ptx(src, metadata)
        if ".entry stream_megakernel(" in text:
            text = ptx.partition_barriers(text, options.num_warps * 32)
        return text

    stages["ptx"] = ptx_stage


def _install_barrier_stage() -> bool:
    """Installs `_named_barrier_stage` (once, after any hook already there); False where this Triton has no stage hook,
    and then attention stays inlined (`StreamConfig.attn_call`)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        return False
    prev = runtime.add_stages_inspection_hook
    if getattr(prev, "megasynth_barriers", False):
        return True

    def hook(backend: Any, stages: dict[str, Any], options: Any, language: Any, capability: Any) -> None:
        _named_barrier_stage(backend, stages, options, language, capability, prev)

    hook.megasynth_barriers = True  # type: ignore[attr-defined]
    runtime.add_stages_inspection_hook = hook
    return True


#: whether attention may run as a function of its own (`StreamConfig.attn_call`): Triton's stage hook is installed
FUNCTIONS_OK = _install_barrier_stage()


@dataclass(frozen=True)
class StreamConfig:
    """Compile-time shape of interpreter v10 (none of it depends on the schedule). `slots` = 0 sizes the ring to fill
    the shared memory the staged activation vector leaves."""

    num_warps: int = 8  # compute partition
    #: registers per thread of the loader warp; 0: by build, 32 for TMA fills (scalar code), 40 on a batch's tiles,
    #: CP_LOADER_REGS with `cp_fill`
    loader_regs: int = 0
    bk: int = 256  # K elements per TMA box (16 rows x bk bf16); at most 256 (TMA box limit)
    boxes: int = 2  # boxes per ring slot (one mbarrier handshake each): 2 or 4
    slots: int = 0  # ring slots; 0: as many as fit
    #: slots the loader keeps in flight at most (0: the whole ring); see `_claim`. A release's fence waits for this
    #: SM's TMA fills in flight to land (`scripts/release_probe.py`): 3 against 4 made llama-1b 1-3 % and llama-3b 0.6 %
    #: faster, llama-8b 0.5 % slower (at ctx 1024 and 32768), so `stream_config` gives 8B-class models 4; 2 cost
    #: llama-8b 5.6 % (docs/perf-notes.md). Counted in batch-1 (16 KB) slots: a batch's 32 KB tile slots keep half as
    #: many fills in flight, rounded up (llama-1b at batch 8: 2 fills 1.6 % faster than 3, 1 fill 12 % slower)
    inflight: int = 3
    #: fills in flight while a batch's QKV tiles stream (0: as many bytes as `inflight`'s batch-1 slots: without
    #: `qkv_kpack` a 64-dim head's QKV tile fills carry 16 KB, so llama-1b keeps 3 of them where its other tile fills
    #: are 2 of 32 KB, 2.0 % faster at batch 8 than 2 QKV fills, 4 the same as 3; K-packed they are 32 KB, 2 in
    #: flight, and 3 measured 0.5 % slower: docs/perf-notes.md)
    qkv_inflight: int = 0
    #: fills in flight while a batch's gate/up tiles stream (0: by build, half the ring where that is more than
    #: `inflight`'s: llama-1b at batch 8, 3 of 6 slots, 1 % faster than 2; 3 of 5 slots measured slower at llama-1b's
    #: batch 16 and llama-8b's batch 8, as did more fills for down or for attention's K/V: docs/perf-notes.md)
    gate_up_inflight: int = 0
    #: where a batch's QKV tile rows are fewer than a tile half's (64-dim heads: 32 rows of each RoPE half), a fill
    #: packs the same rows at two 64-column sub-chunks into the half's other boxes, and the product takes the two
    #: sub-chunks' operand as one wgmma twice as wide, so no row of the product is wasted and an instruction has half
    #: the slots (`_pair_rows_batch`'s KP). llama-1b at batch 8: 0.891 against 0.910-0.913 ms; at 16 the same
    #: (docs/perf-notes.md)
    qkv_kpack: bool = True
    kv_ring: bool = True  # the loader streams attention's K/V history into the ring too (when the shapes allow)
    #: the loader warp fills the ring by cp.async (16 bytes a thread, arriving on the slot's barrier when they land)
    #: instead of TMA, at batch 1 on the CUDA-core path (elsewhere TMA): a counter release's fence waits for this
    #: SM's TMA fills in flight (1.5 us with 3 in flight while every SM streams), not for another warp's cp.async
    #: (0.5 us; `scripts/release_probe.py --parts ws`). cp.async streams a few % slower than TMA, so it pays where
    #: the chain's latency bounds a step: `stream_config` turns it on up to CP_FILL_HIDDEN (side by side at ctx
    #: 1024: qwen3-1.7b 2-5 % faster, llama-1b 0-2 %, qwen3-0.6b within 1 %; llama-3b 1.7 % and llama-8b 0.6 %
    #: slower). A batch's tile fills by cp.async: from one loader warp copying a slot's boxes unrolled, too slow to
    #: issue (llama-1b batch 8 +11 %); from four warps the releases shrink as at batch 1, but the copies stream
    #: ~9 % slower than TMA (batch 16 +13 %, llama-8b batch 8 +10 %); from one warp copying a box a loop iteration
    #: as fast as TMA, the releases 7.4 -> 4.0 us a layer, but QKV's and down's staging loads queue behind the
    #: copies (llama-1b batch 8 the same, batch 16 -0.7 %, llama-8b batch 8 +3.5 %); and only the fills a release
    #: would wait for by cp.async, 3-4 % faster than the same build with all of them by TMA, whose loader, holding
    #: both kinds of copy, costs 5-13 %. So a batch keeps TMA (docs/perf-notes.md)
    cp_fill: bool = False
    #: attention reads the ring's K/V on the tensor cores (`_attn_ring_mma`: 64-dim heads, 16 positions per warp
    #: row, where its group merge fits the staging buffer) instead of the CUDA cores: correct, but measured slower on
    #: the H200 at every context (llama-1b ctx 32768: 1.237 ms against 1.143; docs/perf-notes.md), so off by default
    attn_mma: bool = False
    #: a batch's attention on the tensor cores with the positions as the products' rows (`_attn_ring_rows`: 16 per
    #: compute warp, K and V in blocks of 128 positions, one 32 KB slot for both (64-dim heads) or one each
    #: (128-dim); on tiles, from batch 8), where the CUDA cores' position lanes spend ~1 us a 64-position slot.
    #: Measured at ctx 1024 (alternating rounds): llama-1b batch 8 1.046 -> 1.025 ms, batch 16 1.375 -> 1.338,
    #: llama-8b batch 8 4.918 -> 4.882 (docs/perf-notes.md)
    attn_rows: bool = True
    #: the CUDA-core attention's softmax in base 2 (q scaled by log2(e) as it is loaded) with the flush-to-zero
    #: ex2: one MUFU.EX2 an exponential instead of five instructions (the range check and two rescales of
    #: `gl.exp`), 48 of the ring loop's 375 instructions a slot on llama-1b (`compile_check.py --loops`). Measured on
    #: the H200: llama-1b 7 % faster at ctx 32768 and 14 % at 131072, qwen3-1.7b 2-3 % at 1024; llama-8b 4 % slower
    #: at 32768 with attention inlined, 7 % faster with `attn_call`. `stream_config` turns it on where it pays
    #: (`attn_exp2_pays`); a plain StreamConfig() leaves it off (docs/perf-notes.md)
    attn_exp2: bool = False
    #: attention (`_op_attn_partial`) as a function of its own rather than inlined into the instruction loop, where
    #: the compiler keeps every op's loop-invariant index arithmetic in registers across it and then serialises the
    #: ring loop's lane shuffles: llama-8b at ctx 32768 5.48 ms inlined -> 5.10 as a function with the base-2
    #: softmax (5.34 without), llama-1b -1.2 % at 32768 and -3.9 % at 131072 (docs/perf-notes.md). Needs Triton's
    #: stage hook, which names the function's barriers for the compute partition (`ptx.partition_barriers`);
    #: without it attention stays inlined
    attn_call: bool = True
    #: at batch 1, every instruction's op runs in one function of its own (`_single_op`) called from the instruction
    #: loop, so no op's loop-invariant arithmetic is held in registers across the others: attention's lane merge
    #: loop models at 587 cycles instead of 1,325 (`compile_check.py --loops`), and qwen3-8b's spill goes. Measured
    #: on the H200 (alternating rounds): llama-1b -1.2 % at ctx 1024, -1.3 % at 32768, -3.2 % at 131072; llama-8b
    #: -1.2 % at 1024, -3.5 % at 32768; qwen3-1.7b -5.1 %, qwen3-0.6b -1.8 %, qwen3-8b -0.3 % at 1024. Batches keep
    #: their ops inlined: as a function llama-1b's batch 8 and 16 took 6 % longer, llama-8b's batch 8 1.5 %
    #: (docs/perf-notes.md). Needs the stage hook, as `attn_call` does
    op_call: bool = True
    #: at batch 1, down's K staged in windows of what QKV, o_proj and attention's lane merge stage anyway (down's
    #: instructions with a longer K range multiply one window at a time), not the whole intermediate size: the
    #: staging buffer shrinks (llama-1b, qwen3-1.7b 32 -> 16 KB; llama-8b, qwen3-8b 64 -> 32 KB) and the ring gains
    #: those slots. The searched schedules split down's K 4 or 8 ways, within one window. Measured on the H200
    #: (alternating rounds, ctx 1024): qwen3-1.7b -1.5 %, llama-1b -0.9 %, llama-8b -0.7 %, qwen3-8b -0.5 %
    #: (docs/perf-notes.md)
    down_window: bool = True
    reduce_splits: int = 16  # attention splits attn_reduce folds with all loads issued at once
    #: the compute warps multiply the ring's weights on the tensor cores (wgmma reads each slot where TMA put it, the
    #: activations as a bf16 hi/lo pair: ~16 mantissa bits) instead of loading them for CUDA-core FMAs. Alone it
    #: drains a ring 1.65x as fast; the whole step is not bound by that and measured +0.5 % (ctx 1024) / +1.1 % (4096),
    #: so it is off by default (docs/perf-notes.md). Needs 2 boxes per slot and every K a multiple of 64 (otherwise the
    #: CUDA-core path runs); makes BK 256.
    mma: bool = False
    #: a batch's activations as bf16 hi/lo pairs (~16 mantissa bits, as `mma` at batch 1) instead of bf16: the MMA
    #: twice as wide, measured 1.46x slower at batch 8 (docs/perf-notes.md); bf16 matches the bf16 PyTorch step
    batch_hilo: bool = False
    #: the smallest batch whose ring slots are [128, 64] tiles of 128 weight rows (`_issue_tile`: every column of the
    #: product used, the wgmma's N 1 or 2 per sequence); smaller batches keep the batch-1 row-pair slots (16 rows x
    #: 256 K per box, a quarter of the product's columns used, N 4 or 8 per sequence). Measured on llama-1b with
    #: [16, 64] boxes and 64 K per slot: the tiles 1.07x faster at batch 8, 1.14x slower at batch 2
    #: (docs/perf-notes.md). A QK-norm model's batch takes tiles whatever this says (`pack.v10_tile_slots`)
    batch_tiles: int = V10_TILE_BATCH
    #: rows of a tile's TMA boxes: 16 (groups past an instruction's rows are not copied) or 32/64 (fewer, larger
    #: boxes; QKV's at most a head's half; rows past the instruction's are copied and unused). 64 against 16: 4-5 %
    #: faster at batch 8 and 16 (docs/perf-notes.md)
    tile_box_rows: int = 64
    #: rows of a batch's QKV tile boxes (of each RoPE half), at most `tile_box_rows` and half a head; 0: by build,
    #: `pack.v10_qkv_box_rows`, the QKV tiles the batch lowering gives filling them. K-packed, a box pair holds only
    #: a tile's own pairs at GR / rows sub-chunks: llama-8b at batch 8, QKV tiles of 32 pairs (64 rows, on 96 SMs)
    #: with 32-row boxes 4.54 ms, with 64-row ones (half the next pairs' rows) 4.62, whole heads on 48 SMs 4.67;
    #: llama-1b at batch 16, tiles of 16 pairs with 16-row boxes 1.065 against whole heads' 1.084 (docs/perf-notes.md)
    qkv_box_rows: int = 0
    #: a QK-norm model's batch (Qwen3) with QKV tiles of RoPE pairs, boxed and K-packed as any model's, the norm
    #: applied apart (`qk_norm_apply`) or inside attention (`attn_partial`'s qk_norm), as the batch lowering applies
    #: it; off: QKV tiles of whole heads that QKV normalises (a batch's QKV then one instruction a head: 32 on
    #: qwen3-1.7b), for schedules whose QKV normalises. Each build runs its own form only
    #: (`pack.check_runs_batched_on_v10`). On: qwen3-1.7b at batch 8 1.756 ms, v9 4.057 (docs/perf-notes.md)
    qk_pairs: bool = True
    #: K columns of a tile's ring slot: 64 (one [128, 64] wgmma tile, 16 KB) or 128 (two, 32 KB: half the handshakes;
    #: 64 where fewer than `MIN_TILE_SLOTS` such slots fit beside the staged operand). 128 measured 0.4-4 % faster
    #: than 64 at batch 8 and 16 (docs/perf-notes.md)
    tile_k: int = 128
    #: a batch's act (gate/up -> down) and attn (attn_reduce -> o_proj) buffers in bf16 rather than fp32: the
    #: products take their operand in bf16 anyway (without `batch_hilo`), so the staged values are the same bits
    #: and down's and o_proj's stages read half the bytes
    act_bf16: bool = True
    #: a batch's residual stream x in "fp32" or "fp16" on tile slots (`batch_tiles`; other builds keep fp32); "": by
    #: build, fp16 there. o_proj and down add into x atomically (fp16: two adjacent rows a 32-bit reduction), the
    #: embedding stores it, and QKV, gate/up and the LM head stage it: every SM of their phase reads all of x from the
    #: L2 at once (at batch 8 on llama-8b 128 KB of fp32 an SM), half the bytes in fp16. Measured at ctx 1024 against
    #: fp32: llama-1b batch 8 -1.3 %, batch 16 -4.2 %, llama-8b batch 8 -4.1 % and 16 -4.3 % (with the stage groups
    #: fp16 x wants, `stage_groups`), the logits' error against the reference the same (1.9e-2 against 1.7e-2,
    #: llama-8b 1.3e-2 against 0.9e-2). fp16 keeps 3 more mantissa bits than the bf16 residual of PyTorch's step, and
    #: its range ends at 65504 (a step whose logits are then not finite raises `runtime.ResidualOverflow`); bf16
    #: measured 5-6.6e-2 (its K-split partial sums each rounded to 8 bits) and is not offered (docs/perf-notes.md)
    x_dtype: str = ""
    #: fp32 values a batch's staging loads at once (`_stage_batch`'s load group: 128 registers a thread at 32 K over
    #: the 8 compute warps). A group's loads wait ~0.7 us on top of their bytes, so fewer groups pay: 32 K against
    #: 16 K measured llama-1b's batch 16 -2.9 %, llama-8b's batch 8 -1.9 % and 16 -6.8 % (docs/perf-notes.md)
    stage_values: int = 32768
    #: a tile build's weight ops stage their operand in this many groups of chunks and start each group's products
    #: (the first row group's slots over its K columns) as soon as it is in shared memory, the next group's loads in
    #: flight (`_staged_rows_batch`); 1 stages it whole first (in `stage_values` groups, one after the other). 0: by
    #: build, whole for a QK-norm model's RoPE-pair build at a hidden size in `STAGE_WHOLE_QK_PAIRS_HIDDEN`
    #: (qwen3-1.7b, whose pipelined builds spill); else 4 where the operand is at most `STAGE_PIPE_VALUES` values and
    #: QKV's tiles are K-packed at most 2 ways (4 ways, the 16-row boxes of 64-dim heads, 4 groups spill 152-192 B);
    #: else with fp16 x (`x_dtype`) 2 up to `STAGE_PIPE_F16_BATCH` sequences and whole past them, with fp32 x the
    #: `stage_values` groups, pipelined where there are several. Measured at ctx 1024 against the whole stage:
    #: llama-1b batch 8 -1.8 % with 4, -1.0 % with 2; with fp32 x llama-8b batch 16 (two groups of 32 K values anyway)
    #: -1.3 %, with fp16 x llama-8b batch 8 -2.7 % with 2; larger operands in more groups spill registers, and
    #: llama-1b's batch 16 took +3 % with 4, llama-8b's batch 8 with fp32 x +2.4 % (4) and +0.5 % (2), its batch 16
    #: with fp16 x +11 % (2) (docs/perf-notes.md)
    stage_groups: int = 0
    be: int = 1024  # embedding copy block
    #: at batch 1, o_proj's and down's K ranges start and end at multiples of `K_VEC` (16 B of fp32 activations), so
    #: their staging loads go as 16-byte vectors: a K start only known at run time made the compiler load the window
    #: element by element, four requests for each vector's. (They start on multiples of `K_ALIGN` anyway, for their
    #: TMA boxes: `pack.check_k_ranges`.)
    k_vec: bool = True

    def __post_init__(self) -> None:
        if self.x_dtype not in X_DTYPES:  # a name, so checked here rather than where the build uses it
            raise ValueError(f"x_dtype must be fp32 or fp16 (or empty: by build), got {self.x_dtype!r}")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, int(n)) - 1).bit_length()


def qk_groups(c: ModelConfig) -> int:
    """QG: the 16-pair groups of one head (`_qkv_group`), padded to a power of two: the columns of QK-norm's
    per-head registers (1 without QK-norm, where nothing uses it)."""
    return _pow2_ceil(-(-c.hd // (2 * 16))) if c.qk_norm else 1


def _group_lanes(c: ModelConfig) -> int:
    """GP: the query heads of one KV head, padded to a power of two (at least 2) for attention's layouts."""
    return max(2, _pow2_ceil(c.group_size))


def attn_exp2_pays(c: ModelConfig) -> bool:
    """Whether the base-2 softmax (`StreamConfig.attn_exp2`) is this model's default: everywhere attention runs as a
    function of its own (`StreamConfig.attn_call`, which needs Triton's stage hook); inlined, everywhere but heads of
    128 dims with 4 or more query heads to a KV head (GP >= 4: llama-8b measured 4 % slower at ctx 32768 with it, its
    loop's lane shuffles serialised)."""
    return FUNCTIONS_OK or c.hd < 128 or _group_lanes(c) < 4


#: hidden sizes from which the loader keeps 4 fills in flight rather than 3 (`StreamConfig.inflight`): llama-8b
#: measured 0.5 % faster with 4 at ctx 1024 and at 32768, llama-1b and llama-3b slower (docs/perf-notes.md)
INFLIGHT4_HIDDEN = 4096
X_DTYPES = ("", "fp32", "fp16")  # `StreamConfig.x_dtype`
CP_FILL_HIDDEN = 2048  # `StreamConfig.cp_fill` up to this hidden size, where a step is bound by the chain's latency
#: the largest staged operand (fp32 values: the batch, padded, times the hidden size) that the weight ops may stage
#: in 4 pipelined groups by default (`StreamConfig.stage_groups`): llama-1b's at batch 8 with fp32 x and 32-row QKV
#: boxes
STAGE_PIPE_VALUES = 16384
#: with x in fp16 (`StreamConfig.x_dtype`), the largest padded batch whose larger operands stage in 2 pipelined
#: groups by default; larger batches stage whole. Measured against fp16's whole stage: llama-8b batch 8 -2.7 % with
#: 2; at batch 16 2 groups spill 192 B and took 5.98 ms against the whole stage's 5.38 (docs/perf-notes.md)
STAGE_PIPE_F16_BATCH = 8
#: hidden sizes at which a QK-norm model's RoPE-pair batch build (`StreamConfig.qk_pairs`) stages whole at batch 8
#: (where the rules below would pipeline it): qwen3-1.7b's pipelined builds spill (40 B in 2 groups) and its whole
#: stage (none) measured 1.548 ms against 1.681 (2 groups) and 1.784 (4); qwen3-0.6b's and -8b's 2 groups do not
#: spill and measured 3.5 and 4.6 % faster than their whole stage, which does (docs/perf-notes.md)
STAGE_WHOLE_QK_PAIRS_HIDDEN = frozenset({2048})


def stream_config(c: ModelConfig | None = None) -> StreamConfig:
    """Interpreter v10's defaults for model `c`: `StreamConfig()` with the settings that depend on its shape."""
    if c is None:
        return StreamConfig()
    return StreamConfig(attn_exp2=attn_exp2_pays(c), inflight=4 if c.hidden_size >= INFLIGHT4_HIDDEN else 3,
                        cp_fill=c.hidden_size <= CP_FILL_HIDDEN)


def batch_limits(c: ModelConfig, sc: StreamConfig, batch: int) -> str | None:
    """Why interpreter v10 cannot build for `batch` sequences of this model (None: it can). A batch runs on the
    tensor cores (`_pair_rows_batch`), so every K must be a multiple of 64 and a slot two boxes; a QK-norm model's
    batch takes tile slots (`pack.v10_tile_slots`) with the norm inside QKV, or with `qk_pairs` the slots and QKV tiles
    of any model with the norm apart or inside attention (`pack.check_runs_batched_on_v10`)."""
    why = batch_model_limits(c, batch)
    if why is None and batch > 1 and sc.boxes != 2:
        return f"a batch needs 2 boxes per ring slot (boxes = {sc.boxes})"
    return why


def _rows_wanted(c: ModelConfig, sc: StreamConfig, tile: bool) -> bool:
    """Whether a batch's attention may take `_attn_ring_rows` (tile slots, 64- or 128-dim heads, `attn_rows` on and
    `attn_mma`, asked for by name, off); `stream_geometry` then checks that its blocks fit the ring."""
    return sc.attn_rows and not sc.attn_mma and tile and c.hd in (64, 128)


def stream_geometry(c: ModelConfig, sc: StreamConfig, batch: int = 1) -> dict[str, int]:
    """BK, chunks of the staged vector, ring slots and shared-memory bytes for one model config and batch.

    A batch (NB > 1 sequences) runs on the tensor cores with one staged operand of NBP (the batch padded to a power of
    two) sequences' hi/lo rows per chunk: NBP times the batch-1 operand's bytes. Its o_proj and down instructions
    stage at most as many chunks as the hidden size at a time (K windows of `stage_k`, `_load_k`), so a batch costs
    ring slots, not a vector the shared memory cannot hold."""
    if sc.boxes not in (2, 4):
        raise ValueError(f"boxes per slot must be 2 or 4, got {sc.boxes}")
    if sc.tile_k not in (64, 128):
        raise ValueError(f"tile_k must be 64 or 128, got {sc.tile_k}")
    if sc.tile_box_rows not in (16, 32, 64):
        raise ValueError(f"tile_box_rows must be 16, 32 or 64, got {sc.tile_box_rows}")
    if sc.qkv_box_rows not in (0, 16, 32, 64):
        raise ValueError(f"qkv_box_rows must be 0 (by build), 16, 32 or 64, got {sc.qkv_box_rows}")
    why = batch_limits(c, sc, batch)
    if why:
        raise ValueError(f"interpreter v10 cannot run this batch: {why}")
    # the tensor-core path views each weight matrix [rows, K / 64, 64] for TMA: every K a multiple of 64
    mma = (sc.mma or batch > 1) and sc.boxes == 2 and all(k % 64 == 0 for k in (c.hidden_size, c.q_size,
                                                                                 c.intermediate_size))
    # the tensor-core path's box is four [16, 64] TMA boxes (a 64-row wgmma tile); past K they are zero-filled
    bk = 256 if mma else min(sc.bk, 256, _pow2_floor(c.hidden_size))
    chunks = {n: _pow2_ceil(-(-k // bk)) for n, k in (("NCHH", c.hidden_size), ("NCHQ", c.q_size),
                                                       ("NCHI", c.intermediate_size))}
    # the tensor-core path merges attention heads into fp32 scratch right after the NCHQ operand chunks; attention
    # merges its position lanes through the buffer too ([GP, num_warps, hd] fp32)
    gp = _group_lanes(c)
    # a batch's operand, the batch padded to nbp: with tiles, per 64-column sub-chunk of K, cps rows per sequence
    # (bf16, or hi/lo; nbp >= 8, a wgmma's N is a multiple of 8); on row-pair slots, as batch 1's tensor-core
    # operand, per chunk of bk, cps = 4 rows per sequence (its 64-column sub-chunks), 8 with hi/lo
    qk_heads = c.qk_norm and not sc.qk_pairs  # a batch's QKV normalises whole heads (`StreamConfig.qk_pairs`)
    tile = v10_tile_slots(c, batch, sc.batch_tiles, qk_heads)
    nbp = max(8, _pow2_ceil(batch)) if tile else _pow2_ceil(batch)
    cps = (2 if sc.batch_hilo or batch == 1 else 1) * (1 if tile else bk // 64)
    row_bytes = (bk // 64 if tile else 1) * cps * nbp * 128 if batch > 1 else bk * 4  # staged bytes per chunk
    window = 0  # K columns of a K window (`_load_k`'s KW), in chunks; 0: none
    if batch > 1:  # o_proj and down stage at most the hidden size's chunks; attention's lane merge fits the rest
        window = chunks["NCHH"]
        chunks["NCHQ"] = min(chunks["NCHQ"], chunks["NCHH"])
        chunks["NCHI"] = min(chunks["NCHI"], chunks["NCHH"])
        # heads of attention's lane merge: at least 8 where `_attn_ring_rows` may run (its product's columns)
        hn = max(8, gp) if _rows_wanted(c, sc, tile) else gp
        nch = max(chunks["NCHH"], -(-hn * sc.num_warps * (2 * c.hd) * 4 // row_bytes))
    else:
        nch = max(chunks["NCHH"], chunks["NCHQ"], 2 * chunks["NCHQ"] if mma else 0,
                  -(-gp * sc.num_warps * (2 * c.hd) // bk), 16 * sc.num_warps * c.hd // bk if sc.attn_mma else 0)
        if sc.down_window and chunks["NCHI"] > _pow2_floor(nch):  # down's K in windows of what the rest needs
            window = chunks["NCHI"] = _pow2_floor(nch)
        nch = max(nch, chunks["NCHI"])
    kt = sc.tile_k // 64 if tile else 1  # wgmma tiles per ring slot
    slot_bytes = sc.boxes * 16 * bk * 2 * kt
    stage_bytes = nch * row_bytes
    # (a batch's epilogue brings both halves of a tile's products together through the slot it has just consumed,
    # `_slot_exchange`, not through the compiler's shared scratch)
    fit = (SMEM_LIMIT - SMEM_RESERVE - stage_bytes) // slot_bytes
    if kt > 1 and fit < MIN_TILE_SLOTS and not sc.slots:  # a large staged operand (llama-8b at batch 16): 16 KB slots
        kt, slot_bytes = 1, slot_bytes // kt
        fit = (SMEM_LIMIT - SMEM_RESERVE - stage_bytes) // slot_bytes
    slots = sc.slots or fit
    # `StreamConfig.inflight` counts batch-1 slots: a batch's tile slots of kt wgmma tiles keep as many bytes in
    # flight, in kt times fewer fills (rounded up), since a release's fence waits for them all
    inflight = min(-(-sc.inflight // kt) if sc.inflight else slots, slots)
    # a batch's QKV tile fills carry QXR of each half's rows (`qkv_box_rows`): fewer bytes than a slot where QXR < 64,
    # so as many bytes in flight are more of them (`StreamConfig.qkv_inflight`)
    qbox = sc.qkv_box_rows or v10_qkv_box_rows(c.hd, batch, qk_heads)
    qxr = min(sc.tile_box_rows, qbox, c.hd // 2) if sc.tile_box_rows > 16 else 16
    # ... unless K-packed: a half's GR / QXR boxes hold the same rows at consecutive sub-chunks (`_issue_tile`)
    # (not with the QK-norm: its epilogue takes a head's pairs in one slot half, `_op_qkv_batch`)
    qkp = GR.value // qxr if (tile and sc.qkv_kpack and not qk_heads
                              and c.hidden_size % (64 * kt * (GR.value // qxr)) == 0) else 1
    qkv_fill = 2 * qxr * 64 * kt * 2 * qkp if tile else slot_bytes
    qin = min(sc.qkv_inflight or (-(-sc.inflight * (slot_bytes // kt) // qkv_fill) if sc.inflight else slots), slots)
    if slots < 2 or slots > fit:
        raise ValueError(f"{slots} ring slots of {slot_bytes} B do not fit next to a {stage_bytes} B vector "
                         f"staging buffer (at most {fit})")
    # K/V history blocks fill a slot's first two boxes: BTK positions of hd bf16 each, a multiple of attention's
    # position lanes (32 / (hd / 8) lanes per warp along positions, times the compute warps)
    btk = 16 * bk // c.hd if (16 * bk) % c.hd == 0 else 0
    bt = (32 // min(32, c.hd // 8)) * sc.num_warps if c.hd % 8 == 0 else 0
    kv_ring = sc.kv_ring and btk > 0 and bt > 0 and btk % bt == 0
    # a batch's attention on the tensor cores with positions as rows (`_attn_ring_rows`): 16 per compute warp, K and V
    # in [16 num_warps, 64] blocks (128 B rows), a K/V pair in one slot or two, and the merge in the staging buffer
    kv_block = 16 * sc.num_warps * 64 * 2
    kps = slot_bytes // kv_block  # blocks per slot
    rows = (kv_ring and _rows_wanted(c, sc, tile)
            and slot_bytes % kv_block == 0 and kps >= 1 and (2 * c.hd // 64) % kps == 0
            and (2 * c.hd // 64) // kps <= 2 and slots >= 2 * ((2 * c.hd // 64) // kps)
            and max(8, gp) * sc.num_warps * (2 * c.hd) * 4 <= stage_bytes)
    if rows:
        btk = 16 * sc.num_warps
    # the tensor cores read the K/V blocks as NWB = BTK / 16 groups of 16 positions, each on num_warps / NWB warps,
    # and merge the groups' [16 num_warps / NWB, hd] outputs through the staging buffer
    nwb = btk // 16
    attn_mma = (kv_ring and sc.attn_mma and c.hd == 64 and nwb >= 1 and btk % 16 == 0 and sc.num_warps % nwb == 0
                and 16 * sc.num_warps * c.hd * 4 <= stage_bytes)
    # attn_reduce_o_proj merges MB heads at a time into the staged chunks, which hold NCHQ * BK / hd heads
    heads = chunks["NCHQ"] * bk // c.hd
    if (chunks["NCHQ"] * bk) % c.hd or heads & (heads - 1):
        raise ValueError(f"head_dim {c.hd} must divide the staged attention vector ({chunks['NCHQ']} x {bk}) into a "
                         "power-of-two number of heads")
    # a batch's staging loads at most `stage_values` fp32 values at once: CG chunks of every sequence on tiles (in
    # at least `stage_groups` groups), CG sequences' whole vectors on row-pair slots (`_stage_batch`)
    if sc.stage_groups < 0:
        raise ValueError(f"stage_groups must be 0 (by build) or more, got {sc.stage_groups}")
    x_dtype = (sc.x_dtype or "fp16") if tile else "fp32"
    if sc.stage_groups:
        groups, pipe = sc.stage_groups, sc.stage_groups != 1
    elif x_dtype == "fp16" and c.qk_norm and not qk_heads and c.hidden_size in STAGE_WHOLE_QK_PAIRS_HIDDEN:
        groups, pipe = 1, False  # qwen3-1.7b's RoPE-pair build: its pipelined stage spills
    elif nbp * c.hidden_size <= STAGE_PIPE_VALUES and qkp <= 2 and chunks["NCHH"] >= 2 * 4:
        # 4 groups of at least 2 chunks each (with QKV K-packed 4 ways they spill; so do groups of one chunk at
        # batch 8: qwen2.5-0.5b 192 B, qwen3-0.6b 224 B, against 64 and 0 in 2 groups)
        groups, pipe = 4, True
    elif x_dtype == "fp16":  # two pipelined groups at batch 8, whole at 16 (spills otherwise)
        groups, pipe = (2, True) if nbp <= STAGE_PIPE_F16_BATCH else (1, False)
    else:
        groups, pipe = 1, True  # the `stage_values` groups, pipelined where there are several
    cg = max(1, min(chunks["NCHH"] // _pow2_ceil(groups), _pow2_floor(sc.stage_values // (nbp * bk)))) \
        if tile else min(nbp, _pow2_floor(sc.stage_values // (chunks["NCHH"] * bk)))
    return {"BK": bk, "NCH": nch, **chunks, "NS": slots, "INFLIGHT": inflight, "ring_bytes": slots * slot_bytes,
            "stage_bytes": stage_bytes, "BTK": btk if kv_ring else 16,
            "KV_RING": 3 if rows else 2 if attn_mma else int(kv_ring), "MB": min(8, heads),
            "MMA": mma, "NB": batch, "NBP": nbp, "CG": cg, "CPS": cps, "TILE": tile, "KT": kt, "XR": sc.tile_box_rows,
            "QXR": qxr, "QKP": qkp, "QKH": batch > 1 and qk_heads,
            "SPIPE": tile and chunks["NCHH"] > cg and pipe, "QIN": qin, "stage_k": window * bk,
            "GIN": min(sc.gate_up_inflight or max(inflight, slots // 2 if tile else 0), slots),
            "KVW": 64 if rows else c.hd, "ACT_BF16": batch > 1 and sc.act_bf16 and not sc.batch_hilo,
            "X_DTYPE": x_dtype,
            "CPF": sc.cp_fill and batch == 1 and not mma and not rows and not attn_mma,
            "KA": K_VEC if batch == 1 and sc.k_vec and not mma and all(
                k % K_VEC == 0 for k in (c.q_size, c.intermediate_size)) else 1}


def stream_constexprs(c: ModelConfig, max_seq_len: int, sc: StreamConfig, trace: bool, batch: int = 1
                      ) -> dict[str, Any]:
    """The compile-time parameters of interpreter v10 for one model config and batch (launch options included): a
    new batch size is a new build, a new schedule for the same batch is not."""
    geo = stream_geometry(c, sc, batch)
    return dict(
        H=c.hidden_size, IS=c.intermediate_size, NH=c.num_attention_heads, NKV=c.num_key_value_heads, HD=c.hd,
        S=max_seq_len, V=c.vocab_size, EPS=float(c.rms_norm_eps), SCALE=1.0 / math.sqrt(c.hd), G=c.group_size,
        GP=_group_lanes(c), QKV_BIAS=c.qkv_bias, QK_NORM=c.qk_norm, QG=qk_groups(c), NS=geo["NS"],
        INFLIGHT=geo["INFLIGHT"], QIN=geo["QIN"], SB=sc.boxes, NCH=geo["NCH"], NCHH=geo["NCHH"],
        NCHQ=geo["NCHQ"], NCHI=geo["NCHI"], BK=geo["BK"], BTK=geo["BTK"], KV_RING=geo["KV_RING"],
        ATTN_EXP2=sc.attn_exp2, ATTN_CALL=sc.attn_call and FUNCTIONS_OK,
        OP_CALL=sc.op_call and FUNCTIONS_OK, TRACE=trace, ROWW=ROW, WB=16,
        SP=max(1, sc.reduce_splits), MB=geo["MB"],
        BE=min(sc.be, 1 << (c.hidden_size - 1).bit_length()),
        LOADER_REGS=sc.loader_regs or (CP_LOADER_REGS if geo["CPF"] else TILE_LOADER_REGS if geo["TILE"] else 32),
        MMA=geo["MMA"], NB=batch, NBP=geo["NBP"], CG=geo["CG"], CPS=geo["CPS"], KW=geo["stage_k"],
        TILE=geo["TILE"], XR=geo["XR"], QXR=geo["QXR"], KT=geo["KT"], KA=geo["KA"], NL=c.num_hidden_layers,
        CPF=geo["CPF"], QKP=geo["QKP"], QKH=geo["QKH"], SPIPE=geo["SPIPE"], GIN=geo["GIN"],
        num_warps=sc.num_warps)


def stream_descriptors(c: ModelConfig, w: dict[str, Any], k_cache: Any, v_cache: Any, geo: dict[str, Any]
                       ) -> list[Any]:
    """TMA descriptors of what the loader streams, in the kernel's argument order: the six weight matrices (wqkv,
    wo, w_gate, w_up, w_down, lm_head), each viewed 2-D ([layers * rows, K]) with `weight_box` boxes, then the K and V
    caches viewed [layers * kv heads * positions, hd] with a [BTK, hd] box (`kv_box_layout`; [BTK, 64] for
    `_attn_ring_rows`' chunks)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    out = []
    for name in ("wqkv", "wo", "w_gate", "w_up", "w_down", "lm_head"):
        box, wlayout = weight_box(geo, qkv=name == "wqkv")
        t = w[name]
        t2 = t.reshape(-1, t.shape[-1])
        if geo["MMA"] and not geo["TILE"]:
            t2 = t2.reshape(t2.shape[0], -1, 64)
        out.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), box, wlayout))
    for cache in (k_cache, v_cache):
        t2 = cache.reshape(-1, c.hd)
        out.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [geo["BTK"], geo["KVW"]],
                                    kv_box_layout(geo)))
    return out


def kv_box_layout(geo: dict[str, Any]) -> Any:
    """The K/V boxes' shared layout: 128 B swizzle where attention reads them on the tensor cores (`KV_MMA`,
    `KV_ROWS`: 64-dim heads, 128 B rows), unswizzled otherwise."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128 if geo["KV_RING"] >= KV_MMA else 0, element_bitwidth=16,
                                rank=2)


def weight_box(geo: dict[str, Any], qkv: bool = False) -> tuple[list[int], Any]:
    """The weight descriptors' TMA box and shared layout: [16, BK] unswizzled; on the batch-1 tensor-core path
    and on a batch's row-pair slots [16, BK / 64, 64] of the matrix viewed [rows, K / 64, 64], 128 B swizzle (one
    wgmma tile); on a batch's tiles [XR, 64] (QXR rows for wqkv), 128 B swizzle (`_issue_tile`'s boxes)."""
    if geo["TILE"]:
        rows = geo["QXR"] if qkv else geo["XR"]
        return [rows, 64], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if geo["MMA"]:
        return [16, geo["BK"] // 64, 64], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return [16, geo["BK"]], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
