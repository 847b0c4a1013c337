"""How fast can P SMs stream a weight matrix from HBM by TMA, and does the box shape or a pre-tiled layout matter?
(docs/perf-notes.md, "x in fp16 on tile slots".)

A batch's weight ops fill the ring with [64, 64] boxes of bf16 (128 B of each of 64 rows, two boxes a 128-column slot),
where batch 1 copies [16, 256] (512 B a row). If DRAM served short row runs worse, a layout with each tile contiguous
would stream faster. Each of P programs (one an SM) walks its rows' boxes in K order with Triton's pipelined TMA loads,
keeping about INFLIGHT bytes of boxes in flight (stages - 1 boxes), over a [114688, 4096] bf16 matrix (940 MB, 19x the
L2): row-major boxes of several shapes, and the same boxes from a copy laid out tile after tile (each box contiguous).
Prints the copy bandwidth, then one line per case: the median read rate over 15 CUDA-graph replays of 10 launches
(fastest and slowest but one in brackets) and the rate per program.

    python scripts/hbm_layout_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROWS, K = 28672 * 4, 4096  # four llama-8b gate/up matrices' rows
CASES = ((64, 64, 0), (64, 128, 0), (64, 256, 0), (16, 256, 0), (128, 64, 0), (128, 128, 0),
         (64, 64, 1), (128, 64, 1), (128, 128, 1))  # box rows, box columns, tiled layout
SMEM_BOXES = 200 << 10  # at most this many bytes of pipeline stages


@triton.jit
def stream(desc, out, ROWS_PER: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
           TILED: tl.constexpr, NST: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BR, BK], tl.float32)
    NKB: tl.constexpr = K // BK
    n = (ROWS_PER // BR) * NKB
    for i in tl.range(0, n, num_stages=NST):
        rb = pid * (ROWS_PER // BR) + i // NKB
        kb = i % NKB
        if TILED:
            blk = desc.load([(rb * NKB + kb) * BR, 0])
        else:
            blk = desc.load([rb * BR, kb * BK])
        acc += blk.to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def _events_ms(fn, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)


def run(w: torch.Tensor, programs: int, br: int, bk: int, tiled: int, stages: int) -> tuple[float, float, float]:
    """TB/s: median, fastest but one, slowest but one."""
    rows_per = w.shape[0] // programs
    rows_per -= rows_per % br
    if tiled:
        wt = w[: rows_per * programs].view(rows_per * programs // br, br, K // bk, bk).permute(0, 2, 1, 3).contiguous()
        d = TensorDescriptor.from_tensor(wt.view(-1, bk), [br, bk])
    else:
        d = TensorDescriptor.from_tensor(w, [br, bk])
    out = torch.empty(programs, device="cuda")

    def launch() -> None:
        stream[(programs,)](d, out, rows_per, K, br, bk, tiled, stages, num_warps=4)

    launch()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            launch()
    ts = [t / 10 for t in _events_ms(g.replay, 15)]
    tb = rows_per * programs * K * 2 / 1e9
    return tb / ts[len(ts) // 2], tb / ts[1], tb / ts[-2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    args = ap.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    torch.manual_seed(0)
    w = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    a = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ts = _events_ms(lambda: b.copy_(a), 10)
    say(f"copy bandwidth (read+write) {2 * a.numel() * 2 / ts[5] / 1e9:.2f} TB/s")
    for programs in (112, 128, 132):
        for br, bk, tiled in CASES:
            box = br * bk * 2
            for inflight in (64 << 10, 128 << 10):
                stages = inflight // box + 1
                if stages * box > SMEM_BOXES:
                    continue
                med, fast, slow = run(w, programs, br, bk, tiled, stages)
                run_bytes = br * bk * 2 if tiled else bk * 2
                say(f"P={programs:3d} box=[{br:3d},{bk:3d}] run={run_bytes:6d}B tiled={tiled} "
                    f"inflight={inflight >> 10}KB: {med:.3f} TB/s ({fast:.3f}-{slow:.3f}) per SM "
                    f"{med / programs * 1e3:.1f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
