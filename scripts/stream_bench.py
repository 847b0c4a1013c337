"""How fast can one program per SM stream a gate/up-shaped weight tile, with no waits at all? (perf-notes v9)

The megakernel's gate/up instruction reads rows [r, r + 64) of two [8192, 2048] bf16 matrices (512 KB) and takes
~18 us: ~28 GB/s per SM, where 4.19 TB/s over 132 SMs needs 31.7. This script measures the same loop outside the
megakernel, so the waits, the dispatch and the other ops are out of the picture: a persistent kernel, one program per
SM, each walking its 64-row chunk of 16 layers' gate/up weights (1 GiB in all, so nothing is served from L2), once
per layer as a new "instruction" (pipeline prologue and drain included). Variants: the load path (`tl.load` with the
`tl.range` cp.async pipeline, as in the megakernel, or TMA through host tensor descriptors), pipeline depth, warps,
tile shape, and chunk size. Prints one table: time per layer, aggregate TB/s, GB/s per SM, and the ratio to the copy
bandwidth measured in the same run.

    python scripts/stream_bench.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _stream(wg, wu, x_ptr, out_ptr, L, ROWS_PER_LAYER: tl.constexpr, H: tl.constexpr, RPP: tl.constexpr,
            BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr, TMA: tl.constexpr):
    """Each program: for every layer, rows [pid*RPP, (pid+1)*RPP) of both matrices against x (the megakernel's
    gate/up loop). wg/wu are pointers (`tl.load` through the cp.async pipeline) or, with TMA, 2-D tensor
    descriptors over [L * rows, H] whose tiles the TMA engine fetches."""
    NKB: tl.constexpr = H // BK
    NRB: tl.constexpr = RPP // BR
    pid = tl.program_id(0)
    rb = tl.arange(0, BR)
    ks = tl.arange(0, BK)
    for layer in range(0, L):
        acc1 = tl.zeros((BR, BK), tl.float32)
        acc2 = tl.zeros((BR, BK), tl.float32)
        for it in tl.range(0, NRB * NKB, num_stages=NS):
            kb = it % NKB
            r0 = pid * RPP + (it // NKB) * BR
            kk = kb * BK + ks
            v = tl.load(x_ptr + kk, cache_modifier=".cg")
            if TMA:
                w1 = wg.load([layer * ROWS_PER_LAYER + r0, kb * BK])
                w2 = wu.load([layer * ROWS_PER_LAYER + r0, kb * BK])
            else:
                wrow = layer.to(tl.int64) * ROWS_PER_LAYER * H + (r0 + rb)[:, None].to(tl.int64) * H + kk[None, :]
                w1 = tl.load(wg + wrow)
                w2 = tl.load(wu + wrow)
            keep = (kb != 0).to(tl.float32)
            acc1 = acc1 * keep + w1.to(tl.float32) * v[None, :]
            acc2 = acc2 * keep + w2.to(tl.float32) * v[None, :]
            if kb == NKB - 1:
                g = tl.sum(acc1, 1)
                u = tl.sum(acc2, 1)
                tl.store(out_ptr + r0 + rb, g / (1.0 + tl.exp(-g)) * u)


def copy_bandwidth(nbytes: int = 1 << 31) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    ts.sort()
    return 2 * nbytes / ts[len(ts) // 2] / 1e12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "stream_bench_out"))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    H, IS, L = 2048, 8192, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    wg = (torch.randn(L * IS, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    wu = (torch.randn(L * IS, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(H, device="cuda", generator=gen)
    ref = None
    bw = copy_bandwidth()
    layer_bytes = 2 * IS * H * 2
    rows = []

    def run(name: str, kind: str, rpp: int, br: int, bk: int, ns: int, warps: int) -> None:
        nonlocal ref
        progs = IS // rpp
        outv = torch.zeros(IS, device="cuda")
        try:
            if kind == "tma":
                if TensorDescriptor is None:
                    raise RuntimeError("this Triton has no host tensor descriptors")
                a, b = TensorDescriptor.from_tensor(wg, [br, bk]), TensorDescriptor.from_tensor(wu, [br, bk])
            else:
                a, b = wg, wu
            launch = lambda: _stream[(progs,)](a, b, x, outv, L, IS, H, rpp, br, bk, ns, kind == "tma",  # noqa: E731
                                               num_warps=warps)
            launch()
            torch.cuda.synchronize()
            if ref is None:  # last layer's act, from torch
                g = wg[(L - 1) * IS:].float() @ x
                u = wu[(L - 1) * IS:].float() @ x
                ref = g / (1 + torch.exp(-g)) * u
            err = float((outv - ref).norm() / ref.norm())
            ts = []
            for _ in range(args.reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                launch()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) * 1e-3 / L)
            ts.sort()
            med = ts[len(ts) // 2]
            r = {"name": name, "kind": kind, "rows_per_program": rpp, "programs": progs, "tile": [br, bk],
                 "num_stages": ns, "num_warps": warps, "us_per_layer": med * 1e6,
                 "p10_us": ts[len(ts) // 10] * 1e6, "p90_us": ts[(9 * len(ts)) // 10] * 1e6,
                 "tb_s": layer_bytes / med / 1e12, "gb_s_per_sm": layer_bytes / med / 1e9 / min(progs, sms),
                 "of_copy_bw": layer_bytes / med / 1e12 / bw, "rel_err": err}
        except Exception as exc:  # keep going: one failing variant must not hide the others
            r = {"name": name, "kind": kind, "error": repr(exc)[:300]}
        rows.append(r)
        print(json.dumps(r), flush=True)

    run("ldg 64r [32,256] ns3 w8 (megakernel gate/up)", "ldg", 64, 32, 256, 3, 8)
    run("ldg 64r [32,256] ns4 w8", "ldg", 64, 32, 256, 4, 8)
    run("ldg 64r [32,256] ns6 w8", "ldg", 64, 32, 256, 6, 8)
    run("ldg 64r [16,512] ns3 w8", "ldg", 64, 16, 512, 3, 8)
    run("ldg 64r [64,128] ns3 w8", "ldg", 64, 64, 128, 3, 8)
    run("ldg 64r [32,256] ns3 w4", "ldg", 64, 32, 256, 3, 4)
    run("ldg 64r [32,256] ns4 w16", "ldg", 64, 32, 256, 4, 16)
    run("ldg 128r [32,256] ns3 w8 (64 programs)", "ldg", 128, 32, 256, 3, 8)
    run("ldg 32r [32,256] ns3 w8 (256 programs)", "ldg", 32, 32, 256, 3, 8)
    run("tma 64r [32,256] ns3 w8", "tma", 64, 32, 256, 3, 8)
    run("tma 64r [32,256] ns4 w8", "tma", 64, 32, 256, 4, 8)
    run("tma 64r [32,256] ns6 w8", "tma", 64, 32, 256, 6, 8)
    run("tma 64r [64,128] ns4 w8", "tma", 64, 64, 128, 4, 8)
    run("tma 64r [32,256] ns4 w4", "tma", 64, 32, 256, 4, 4)
    run("tma 32r [32,256] ns4 w8 (256 programs)", "tma", 32, 32, 256, 4, 8)

    floor_us = layer_bytes / (bw * 1e12) * 1e6
    result = {"copy_tb_s": bw, "layer_bytes": layer_bytes, "floor_us_per_layer": floor_us, "sms": sms,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "rows": rows}
    (out / "stream_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy bandwidth {bw:.2f} TB/s; floor {floor_us:.1f} us per layer of gate/up (64 MiB)")
    print(f"{'variant':44s} {'us/layer':>9s} {'p10-p90':>13s} {'TB/s':>6s} {'GB/s/SM':>8s} {'of copy':>8s} {'err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:44s} ERROR {r['error'][:80]}")
            continue
        print(f"{r['name']:44s} {r['us_per_layer']:9.2f} {r['p10_us']:6.2f}-{r['p90_us']:6.2f} {r['tb_s']:6.2f} "
              f"{r['gb_s_per_sm']:8.1f} {r['of_copy_bw']:8.2f} {r['rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
