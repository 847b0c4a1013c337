"""What does a counter hop cost, and what makes a release slow? (docs/perf-notes.md, "what a release waits for")

Two CTAs ping-pong on two counters with the megakernel's protocol (ptx.py: stores, CTA barrier, `red.release.gpu`
from thread 0; the other CTA polls with acquire loads, then a CTA barrier: every thread polls in the `load` part, as
interpreter v9 does, the first warp in the `tma` part, as v10 does). Probe 0 times its release (the barrier and the
release add) and the round trip (two hops), the median over 180 hops.

- `load`: while other CTAs stream a 2 GiB array from DRAM with plain loads (each keeping one load of BLOCK fp32 in
  flight), placed anywhere, only on the probes' SMs, or everywhere but there. Asks: do other SMs' reads, or this
  SM's, queue a release?
- `tma`: probe 0 issues NF TMA loads of 16 KB (as the loader warp fills a ring slot) just before its stores, and
  releases with them in flight (`when` 0), or waits for them to land first (`when` 1, which also times the landing).
  Asks: does the release wait for the SM's own fills?
- `ws`: warp-specialized as interpreter v10 on every SM (one program an SM): a compute partition (the probes
  ping-pong) and a one-warp loader that keeps NF fills of 16 KB in flight until the probes are done, by TMA or by
  cp.async (16 bytes a thread, one commit group a fill), on the probes' SMs and on the others. Asks: does a release
  wait for another warp's fills, and for both kinds? (It waits for TMA fills, not for 3 of cp.async.)

    python scripts/release_probe.py [--out DIR] [--parts load,tma,ws]

Writes release_probe.json under --out and prints a table per part. Every spin is bounded by a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402

from megasynth.kernels.gpu import ptx  # noqa: E402

SPIN_NS = 200_000_000  # every wait gives up after 0.2 s (the results would then show it)
HOPS, WARM = 200, 20  # hops per case; the first WARM are not counted
DB = 2048  # fp32 values each probe stores before a release (8 KB)
SLOT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
WS_CP = gl.SwizzledSharedLayout(8, 1, 1, [1, 0])  # cp.async fills: no swizzle (nothing reads them)


@triton.jit
def _wait_ge(ptr, target, t_lim):
    cur = ptx.load_acquire(ptr)
    t0 = ptx.globaltimer()
    while (cur < target) & (ptx.globaltimer() - t0 < t_lim):
        cur = ptx.load_acquire(ptr)
    return cur


@triton.jit
def load_probe(ctr_ptr, data_ptr, big_ptr, res_ptr, stream_ptr, n_iter, n_blocks, n_streamers, t_lim,
               DB: tl.constexpr, BLOCK: tl.constexpr, PLACE: tl.constexpr):
    """Programs 0 and 1 are the probes (ctr[0], ctr[1]: their counters; ctr[10], ctr[11]: their SM + 1; ctr[8]:
    stop); the others stream until stop, kept by PLACE (0 anywhere, 1 on the probes' SMs, 2 elsewhere)."""
    pid = tl.program_id(0)
    if pid >= 2:
        me = ptx.smid()
        tq = ptx.globaltimer()
        p0 = tl.load(ctr_ptr + 10, volatile=True)
        p1 = tl.load(ctr_ptr + 11, volatile=True)
        while ((p0 == 0) | (p1 == 0)) & (ptx.globaltimer() - tq < t_lim):
            p0 = tl.load(ctr_ptr + 10, volatile=True)
            p1 = tl.load(ctr_ptr + 11, volatile=True)
        on_probe = (me == p0 - 1) | (me == p1 - 1)
        keep = (PLACE == 0) | ((PLACE == 1) & on_probe) | ((PLACE == 2) & (not on_probe))
    else:
        keep = False
    if keep:
        sid = pid - 2
        per = n_blocks // n_streamers  # each streamer reads a region of its own: no L2 hits between them
        boffs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        nb = sid * 0
        t0 = ptx.globaltimer()
        stop = tl.load(ctr_ptr + 8, volatile=True)
        while (stop == 0) & (ptx.globaltimer() - t0 < t_lim):
            acc += tl.load(big_ptr + (sid * per + nb % per).to(tl.int64) * BLOCK + boffs, cache_modifier=".cg")
            nb += 1
            if nb % 16 == 0:
                stop = tl.load(ctr_ptr + 8, volatile=True)
        tl.store(stream_ptr + sid * 4, nb.to(tl.int64))
        tl.store(stream_ptr + sid * 4 + 1, t0)
        tl.store(stream_ptr + sid * 4 + 2, ptx.globaltimer())
        tl.store(stream_ptr + sid * 4 + 3, tl.sum(acc, 0).to(tl.int64))
    elif pid < 2:
        tl.store(ctr_ptr + 10 + pid, ptx.smid() + 1)
        tw = ptx.globaltimer()
        while ptx.globaltimer() - tw < 20000:  # 20 us for the streamers to start
            pass
        offs = tl.arange(0, DB)
        mine = ctr_ptr + pid
        other = ctr_ptr + (1 - pid)
        for i in range(n_iter):
            if pid == 1:
                _wait_ge(other, i + 1, t_lim)
                tl.debug_barrier()
            tl.store(data_ptr + pid * DB + offs, (offs + i).to(tl.float32))
            ta = ptx.globaltimer()
            tl.debug_barrier()
            ptx.signal_release(mine, 1)
            tb = ptx.globaltimer()
            if pid == 0:
                _wait_ge(other, i + 1, t_lim)
                tl.debug_barrier()
                tc = ptx.globaltimer()
                tl.store(res_ptr + i * 4, tb - ta)
                tl.store(res_ptr + i * 4 + 1, tc - ta)
        if pid == 0:
            tl.atomic_xchg(ctr_ptr + 8, 1)


@gluon.jit
def _gl_wait_ge(ptr, target, t_lim):
    cur = ptx.gl_load_acquire_lead(ptr)
    t0 = ptx.gl_globaltimer()
    el = t0 - t0
    while (cur < target) & (el < t_lim):
        cur = ptx.gl_load_acquire_lead(ptr)
        el = ptx.gl_globaltimer() - t0
    gl.thread_barrier()
    return cur


@gluon.jit
def tma_probe(d, ctr_ptr, data_ptr, res_ptr, n_iter, row0, t_lim, NF: gl.constexpr, WHEN: gl.constexpr,
              DB: gl.constexpr, num_warps: gl.constexpr):
    """Probe 0 issues NF [128, 64] bf16 TMA loads (rows far apart, from row0: from DRAM) before its stores each hop."""
    pid = gl.program_id(0)
    smem = gl.allocate_shared_memory(gl.bfloat16, [4, 128, 64], SLOT)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, DB, layout=lay)
    mine = ctr_ptr + pid
    other = ctr_ptr + (1 - pid)
    for i in range(n_iter):
        if pid == 1:
            _gl_wait_ge(other, i + 1, t_lim)
        if NF > 0:
            if pid == 0:
                mbarrier.expect(bar.index(0), NF * 128 * 64 * 2)
                for f in gl.static_range(NF):
                    tma.async_copy_global_to_shared(d, [row0 + (i * 8 + f) * 4096, 0], bar.index(0), smem.index(f))
        gl.store(data_ptr + pid * DB + offs, (offs + i).to(gl.float32))
        gl.thread_barrier()
        tw = ptx.gl_globaltimer()
        if WHEN == 1:
            if NF > 0:
                if pid == 0:
                    mbarrier.wait(bar.index(0), i & 1)
        ta = ptx.gl_globaltimer()
        ptx.gl_signal_release(mine, 1)
        tb = ptx.gl_globaltimer()
        if pid == 0:
            if WHEN == 0:
                if NF > 0:
                    mbarrier.wait(bar.index(0), i & 1)
            _gl_wait_ge(other, i + 1, t_lim)
            tc = ptx.gl_globaltimer()
            gl.store(res_ptr + i * 4, tb - ta)
            gl.store(res_ptr + i * 4 + 1, tc - ta)
            gl.store(res_ptr + i * 4 + 3, ta - tw)


@gluon.jit
def _ws_probe(ctr_ptr, data_ptr, res_ptr, n_iter, t_lim, DB: gl.constexpr, num_warps: gl.constexpr):
    """The compute partition: programs 0 and 1 ping-pong as in `tma_probe` (no fills of their own); then program 0
    sets the stop flag ctr[8] for every loader."""
    pid = gl.program_id(0)
    if pid < 2:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        offs = gl.arange(0, DB, layout=lay)
        mine = ctr_ptr + pid
        other = ctr_ptr + (1 - pid)
        tw = ptx.gl_globaltimer()
        el = tw - tw
        while el < 30000:  # 30 us for every loader to get going
            el = ptx.gl_globaltimer() - tw
        for i in range(n_iter):
            if pid == 1:
                _gl_wait_ge(other, i + 1, t_lim)
            gl.store(data_ptr + pid * DB + offs, (offs + i).to(gl.float32))
            gl.thread_barrier()
            ta = ptx.gl_globaltimer()
            ptx.gl_signal_release(mine, 1)
            tb = ptx.gl_globaltimer()
            if pid == 0:
                _gl_wait_ge(other, i + 1, t_lim)
                tc = ptx.gl_globaltimer()
                gl.store(res_ptr + i * 4, tb - ta)
                gl.store(res_ptr + i * 4 + 1, tc - ta)
        if pid == 0:
            gl.thread_barrier()
            ptx.gl_signal_release(ctr_ptr + 8, 1)


@gluon.jit
def _ws_fill(d, big_ptr, ring, cring, bars, t, row, NF: gl.constexpr, MODE: gl.constexpr):
    """Fill ring slot t % NF with the [128, 64] bf16 rows from `row`: MODE 1 one TMA load (its mbarrier counts the
    bytes), MODE 2 cp.async of 16 bytes a thread into `cring` (one commit group a fill), once fill t - NF has landed."""
    s = t % NF
    if MODE == 1:
        if t >= NF:
            mbarrier.wait(bars.index(s), ((t - NF) // NF) & 1)
        mbarrier.expect(bars.index(s), 128 * 64 * 2)
        tma.async_copy_global_to_shared(d, [row, 0], bars.index(s), ring.index(s))
    else:
        async_copy.wait_group(NF - 1)
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        r = gl.arange(0, 32, layout=gl.SliceLayout(1, lay))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
        off = gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0)
        for q in gl.static_range(4):
            src = big_ptr + (row + q * 32).to(gl.int64) * 64 + off
            async_copy.async_copy_global_to_shared(cring.index(s * 4 + q), src)
        async_copy.commit_group()


@gluon.jit
def _ws_loader(d, big_ptr, ctr_ptr, stat_ptr, ring, cring, bars, rows_per, t_lim, mode_probe, mode_others,
               NF: gl.constexpr):
    """The loader partition (one warp): stream this program's region of the array, NF fills of 16 KB in flight,
    until the stop flag. The probes' loaders fill by mode_probe (0 none, 1 TMA, 2 cp.async), the others' by
    mode_others (runtime values, never specialized: with a constant mode triton 3.6 fails to lower the cp.async
    path)."""
    pid = gl.program_id(0)
    mode = gl.where(pid < 2, mode_probe, mode_others)
    base = pid * rows_per
    t = pid * 0
    t0 = ptx.gl_globaltimer()
    el = t0 - t0
    stop = gl.load(ctr_ptr + 8, volatile=True)
    while (mode > 0) & (stop == 0) & (el < t_lim):
        row = base + (t * 128) % rows_per
        if mode == 1:
            _ws_fill(d, big_ptr, ring, cring, bars, t, row, NF, 1)
        else:
            _ws_fill(d, big_ptr, ring, cring, bars, t, row, NF, 2)
        t += 1
        if t % 8 == 0:
            stop = gl.load(ctr_ptr + 8, volatile=True)
            el = ptx.gl_globaltimer() - t0
    t1 = ptx.gl_globaltimer()
    async_copy.wait_group(0)
    if (mode == 1) & (t > 0):
        for f in range(NF):
            u = t - NF + f
            if u >= 0:
                mbarrier.wait(bars.index(u % NF), (u // NF) & 1)
    gl.store(stat_ptr + pid * 4, t.to(gl.int64))
    gl.store(stat_ptr + pid * 4 + 1, t0)
    gl.store(stat_ptr + pid * 4 + 2, t1)


@gluon.jit(do_not_specialize=["mode_probe", "mode_others"])
def ws_probe(d, big_ptr, ctr_ptr, data_ptr, res_ptr, stat_ptr, n_iter, rows_per, t_lim, mode_probe, mode_others,
             NF: gl.constexpr, DB: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialized as interpreter v10: a compute partition that releases, a one-warp loader that fills."""
    ring = gl.allocate_shared_memory(gl.bfloat16, [6, 128, 64], SLOT)
    cring = gl.allocate_shared_memory(gl.bfloat16, [24, 32, 64], WS_CP)  # with ring, 192 KB: one program an SM
    bars = gl.allocate_shared_memory(gl.int64, [NF, 1], mbarrier.MBarrierLayout())
    for f in gl.static_range(NF):
        mbarrier.init(bars.index(f), count=1)
    gl.warp_specialize([
        (_ws_probe, (ctr_ptr, data_ptr, res_ptr, n_iter, t_lim, DB, num_warps)),
        (_ws_loader, (d, big_ptr, ctr_ptr, stat_ptr, ring, cring, bars, rows_per, t_lim, mode_probe, mode_others, NF)),
    ], [1], [128])


def _medians(res: torch.Tensor) -> dict[str, float]:
    r = res.view(HOPS, 4)[WARM:].cpu()

    def med(k: int) -> float:
        return round(statistics.median(r[:, k].tolist()) / 1e3, 3)

    def pct(k: int, q: float) -> float:
        return round(sorted(r[:, k].tolist())[int(q * (len(r) - 1))] / 1e3, 3)

    return {"release_us": med(0), "hop2_us": med(1), "hop2_p10_us": pct(1, 0.1), "hop2_p90_us": pct(1, 0.9),
            "land_first_us": med(3)}


def run_load(n_stream: int, block_kb: int, place: int, big: torch.Tensor) -> dict:
    block = block_kb * 256
    ctr = torch.zeros(16, dtype=torch.int32, device="cuda")
    data = torch.zeros(2 * DB, dtype=torch.float32, device="cuda")
    res = torch.zeros(HOPS * 4, dtype=torch.int64, device="cuda")
    st = torch.zeros(max(n_stream, 1) * 4, dtype=torch.int64, device="cuda")
    load_probe[(2 + n_stream,)](ctr, data, big, res, st, HOPS, big.numel() // block, max(n_stream, 1), SPIN_NS,
                                DB=DB, BLOCK=block, PLACE=place, num_warps=8)
    torch.cuda.synchronize()
    out = {"streamers": n_stream, "block_kb": block_kb, "place": ["anywhere", "probe SMs", "elsewhere"][place],
           **_medians(res)}
    s = st.view(-1, 4).cpu()
    s = s[s[:, 0] > 0]
    out["kept"] = len(s)
    out["inflight_mb"] = round(len(s) * block * 4 / 1e6, 1)
    span = (s[:, 2].max() - s[:, 1].min()).item() if len(s) else 0
    out["stream_tb_s"] = round(s[:, 0].sum().item() * block * 4 / span / 1e3, 2) if span else 0.0
    return out


def run_tma(nf: int, when: int, big: torch.Tensor, row0: int) -> dict:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = TensorDescriptor(big, list(big.shape), list(big.stride()), [128, 64], SLOT)
    ctr = torch.zeros(16, dtype=torch.int32, device="cuda")
    data = torch.zeros(2 * DB, dtype=torch.float32, device="cuda")
    res = torch.zeros(HOPS * 4, dtype=torch.int64, device="cuda")
    tma_probe[(2,)](d, ctr, data, res, HOPS, row0, SPIN_NS, NF=nf, WHEN=when, DB=DB, num_warps=4)
    torch.cuda.synchronize()
    return {"fills": nf, "when": ["in flight", "landed first"][when], **_medians(res)}


def run_ws(nf: int, mode: int, others: int, big: torch.Tensor, n_prog: int) -> dict:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = TensorDescriptor(big, list(big.shape), list(big.stride()), [128, 64], SLOT)
    ctr = torch.zeros(16, dtype=torch.int32, device="cuda")
    data = torch.zeros(2 * DB, dtype=torch.float32, device="cuda")
    res = torch.zeros(HOPS * 4, dtype=torch.int64, device="cuda")
    stat = torch.zeros(n_prog * 4, dtype=torch.int64, device="cuda")
    rows_per = (big.shape[0] // n_prog) // 128 * 128
    ws_probe[(n_prog,)](d, big, ctr, data, res, stat, HOPS, rows_per, SPIN_NS, mode, others, NF=nf, DB=DB, num_warps=4)
    torch.cuda.synchronize()
    s = stat.view(-1, 4).cpu()
    s = s[s[:, 0] > 0]
    span = (s[:, 2].max() - s[:, 1].min()).item() if len(s) else 0
    probe_rate = [round(s_[0].item() * 16384 / max(1, (s_[2] - s_[1]).item()), 1)
                  for s_ in stat.view(-1, 4).cpu()[:2] if s_[0] > 0]
    kinds = ["none", "tma", "cp.async"]
    return {"fills": nf, "probe fills": kinds[mode], "other SMs": ["idle", *kinds[1:]][others],
            "stream_tb_s": round(s[:, 0].sum().item() * 16384 / span / 1e3, 2) if span else 0.0,
            "probe_kb_per_us": probe_rate, **_medians(res)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="load,tma,ws")
    args = ap.parse_args()
    parts = args.parts.split(",")
    rows: dict[str, list[dict]] = {}
    if "load" in parts:
        big = torch.ones(1 << 29, dtype=torch.float32, device="cuda")  # 2 GiB: far beyond the L2
        cases = [(0, 16, 0)] + [(n, kb, place) for place in (0, 2) for n, kb in ((390, 16), (390, 32), (520, 32))]
        cases += [(660, 16, 1), (660, 32, 1), (1320, 32, 1)]
        rows["load"] = []
        for c in cases:
            run_load(*c, big)  # compile and warm
            rows["load"].append(run_load(*c, big))
        del big
        print(f"{'place':>10} {'kept':>5} {'blk KB':>6} {'MB fly':>6} {'TB/s':>5} {'release':>7} {'2 hops':>6} "
              f"{'p10':>5} {'p90':>5}")
        for o in rows["load"]:
            print(f"{o['place']:>10} {o['kept']:>5} {o['block_kb']:>6} {o['inflight_mb']:>6.1f} "
                  f"{o['stream_tb_s']:>5.2f} {o['release_us']:>7.2f} {o['hop2_us']:>6.2f} {o['hop2_p10_us']:>5.2f} "
                  f"{o['hop2_p90_us']:>5.2f}")
    if "tma" in parts:
        big = torch.ones((8 << 20, 64), dtype=torch.bfloat16, device="cuda")  # 1 GiB
        rows["tma"] = []
        for nf, when in ((0, 0), (1, 0), (3, 0), (1, 1), (3, 1)):
            run_tma(nf, when, big, 0)  # compile and warm; the timed run reads other rows (not in the L2)
            rows["tma"].append(run_tma(nf, when, big, 1024 + 128 * nf + 512 * when))
        print(f"{'fills':>5} {'release':>14} {'release us':>10} {'2 hops':>6} {'land us':>7}")
        for o in rows["tma"]:
            print(f"{o['fills']:>5} {o['when']:>14} {o['release_us']:>10.2f} {o['hop2_us']:>6.2f} "
                  f"{o['land_first_us']:>7.2f}")
    if "ws" in parts:
        big = torch.ones((8 << 20, 64), dtype=torch.bfloat16, device="cuda")  # 1 GiB
        n_prog = torch.cuda.get_device_properties(0).multi_processor_count
        rows["ws"] = []
        for nf, mode, others in ((3, 0, 0), (3, 1, 0), (3, 2, 0), (3, 0, 1), (3, 1, 1), (3, 2, 1), (6, 2, 1),
                                 (2, 1, 1), (2, 2, 1), (3, 2, 2), (6, 2, 2)):
            run_ws(nf, mode, others, big, n_prog)
            rows["ws"].append(run_ws(nf, mode, others, big, n_prog))
        print(f"{'fills':>5} {'probe fills':>11} {'others':>8} {'TB/s':>5} {'probe KB/us':>12} {'release':>7} "
              f"{'2 hops':>6} {'p10':>5} {'p90':>5}")
        for o in rows["ws"]:
            print(f"{o['fills']:>5} {o['probe fills']:>11} {o['other SMs']:>8} {o['stream_tb_s']:>5.2f} "
                  f"{str(o['probe_kb_per_us']):>12} {o['release_us']:>7.2f} {o['hop2_us']:>6.2f} "
                  f"{o['hop2_p10_us']:>5.2f} {o['hop2_p90_us']:>5.2f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "release_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                   "hops": HOPS - WARM, **rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
