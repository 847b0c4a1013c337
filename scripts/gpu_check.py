"""Build, check and time the persistent megakernel in one device call (METHOD.md: one script, a short table last).

    python scripts/gpu_check.py [--out DIR] [--quick] [--variants a,b,...] [--ctx 128,1024,4096]

1. environment + copy bandwidth (the floor's denominator), 2. correctness on tiny configs (naive and a different
assignment/counter layout) against megasynth.kernels.reference, the watchdog on a schedule that deadlocks, 3. llama-1b
correctness at positions >= 2048 over a random KV history, 4. timings (CUDA-graph replays of the whole step) of kernel
and lowering variants at several contexts, 5. one traced step exported as trace.json with its summary. Full results
go to DIR/gpu_check.json; the table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megasynth.ir.model import ModelConfig  # noqa: E402
from megasynth.ir.schedule import parse_schedule  # noqa: E402
from megasynth.kernels.gpu import KernelConfig, Megakernel, WatchdogError  # noqa: E402
from megasynth.kernels.gpu.stream import StreamConfig  # noqa: E402
from megasynth.kernels.gpu.timing import time_schedule  # noqa: E402
from megasynth.kernels.reference import decode_step  # noqa: E402
from megasynth.kernels.weights import random_weights  # noqa: E402
from megasynth.lowering.lower import lower  # noqa: E402
from megasynth.lowering.models import get_model  # noqa: E402
from megasynth.lowering.strategy import Strategy  # noqa: E402
from megasynth.trace import format_summary, summarize, write_trace  # noqa: E402

RESULTS: dict[str, Any] = {"checks": [], "timings": [], "errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def gpu_random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """megasynth.kernels.weights.random_weights drawn on the GPU (a 1.2B-parameter model in a second), bf16."""
    from megasynth.kernels.weights import random_weights

    return random_weights(cfg, seed=seed, dtype=torch.bfloat16, device="cuda", draw_on="cuda")


def variant_schedule(spec: Any, workers: int, strategy: Strategy, reverse: bool = False, shuffle_counters: int = 0):
    """The lowering, optionally with the worker assignment reversed and the counter ids permuted."""
    doc = lower(spec, workers, strategy).to_json()
    if reverse:
        doc["queues"] = list(reversed(doc["queues"]))
    if shuffle_counters:
        n = doc["counters"]
        perm = list(range(n))
        import random

        random.Random(shuffle_counters).shuffle(perm)
        doc["counters"] = n + 7  # unused counters are legal
        for ins in doc["instructions"]:
            for w in ins.get("waits", []):
                w["counter"] = perm[w["counter"]] + 7
            for s in ins.get("signals", []):
                s["counter"] = perm[s["counter"]] + 7
    return parse_schedule(doc)


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict[str, Any]:
    rel = float((out - ref).norm() / ref.norm())
    top2 = torch.topk(ref, 2).values
    margin = float(top2[0] - top2[1])
    same = int(out.argmax()) == int(ref.argmax())
    return {"rel_l2": rel, "margin": margin, "same_token": same, "finite": bool(torch.isfinite(out).all())}


#: Interpreter variants: --kernels (correctness) and --variants (timing) name them.
VARIANTS: dict[str, Any] = {
    "v0": KernelConfig(attn_mma=False, prefetch=0, bt=32),  # fp32 broadcast attention (the first version)
    "base": KernelConfig(),
    "v9": KernelConfig(),  # = base: interpreter v9 as committed
    "v10": StreamConfig(),  # interpreter v10: TMA ring fed by a loader warp that runs ahead of the waits
    "v10s4": StreamConfig(slots=4),  # v10 with a shallow ring (4 x 16 KB): how much the depth matters
    "v10s8": StreamConfig(slots=8),
    "v10s11": StreamConfig(slots=11),  # the ring a 12 KB shared-memory reserve left
    "v10b4": StreamConfig(boxes=4),  # 4 boxes (32 KB) per slot: half the handshakes per byte
    "v10kv0": StreamConfig(kv_ring=False),  # attention loads its K/V history itself
    "v10e2": StreamConfig(attn_exp2=True),  # attention's softmax in base 2, one MUFU.EX2 an exp
    "v10i0": StreamConfig(inflight=0),  # no bound on the loader's backlog (the first v10)
    "v10i2": StreamConfig(inflight=2),
    "v10i3": StreamConfig(inflight=3),  # = v10
    "v10i4": StreamConfig(inflight=4),
    "v10i6": StreamConfig(inflight=6),
    "v10i8": StreamConfig(inflight=8),
    "v10b4i2": StreamConfig(boxes=4, inflight=2),
    "v10mma": StreamConfig(mma=True),  # the tensor cores read the ring's slots (wgmma)
    "v10lr56": StreamConfig(loader_regs=56),
    "pf8k": KernelConfig(prefetch=1, pf_cap=8 << 10),
    "pf32k": KernelConfig(prefetch=1, pf_cap=32 << 10),
    "pfall": KernelConfig(prefetch=1),
    "ns1": KernelConfig(num_stages=1),
    "bk1024": KernelConfig(bk_o=1024, bk_gu=1024, bk_d=1024, bk_lm=1024, bk_qkv=512),
    "bk256": KernelConfig(bk_o=256, bk_gu=256, bk_d=256, bk_lm=256, bk_qkv=256),
    "bt128": KernelConfig(bt=128),
    "w4": KernelConfig(num_warps=4),
    "noflat": KernelConfig(flat=False),
    "gubr32": KernelConfig(br_gu=32, bk_gu=256),
    "lmbr64": KernelConfig(br_lm=64, bk_lm=256),
    "flatns4": KernelConfig(num_stages=4),
    "bd1024": KernelConfig(bk_d=1024),
    "qkv512": KernelConfig(bk_qkv=512),
    "gu1632": KernelConfig(br_gu=16, bk_gu=512),  # the gate/up tile before v5
    "sp8": KernelConfig(reduce_splits=8),  # v8: attn_reduce unrolled over 8 splits (default 16)
    "sp1": KernelConfig(reduce_splits=1),  # v8 with one unrolled split: close to the v6 loop
    # v9: L2 warm-up of o_proj / the first rows of gate/up at the start of each layer
    "wo": KernelConfig(warm_o=True),
    "wg16": KernelConfig(warm_gu=16),
    "wg32": KernelConfig(warm_gu=32),
    "wg64": KernelConfig(warm_gu=64),
    "wo_g16": KernelConfig(warm_o=True, warm_gu=16),
    "wo_g32": KernelConfig(warm_o=True, warm_gu=32),
    "ns4": KernelConfig(num_stages=4),  # = v9
    "ns3": KernelConfig(num_stages=3),  # the previous default
    "wo_ns4": KernelConfig(warm_o=True, num_stages=4),
    "wo_ns5": KernelConfig(warm_o=True, num_stages=5),
    "wo_ns4_a4": KernelConfig(warm_o=True, num_stages=4, ns_attn=4),
    "a1": KernelConfig(ns_attn=1),  # no K/V pipelining in attention (16 splits: one block per split at ctx 1024)
    "a2": KernelConfig(ns_attn=2),
}


def check_model(name: str, cfg: ModelConfig, weights: dict[str, torch.Tensor], schedule: Any, label: str,
                positions: list[int], history: int, max_seq_len: int, tol: float = 2e-2, kernel: str = "v10") -> bool:
    """Decode `positions` with the megakernel and the reference from the same random KV history; record the check."""
    mk = Megakernel(schedule, weights, max_seq_len=max_seq_len, config=VARIANTS[kernel])
    label = f"{kernel} {label}"
    gen = torch.Generator(device="cuda").manual_seed(1234)
    if history:
        mk.k_cache[:, :, :history].copy_(torch.randn(mk.k_cache[:, :, :history].shape, generator=gen,
                                                     device="cuda") * 0.5)
        mk.v_cache[:, :, :history].copy_(torch.randn(mk.v_cache[:, :, :history].shape, generator=gen,
                                                     device="cuda"))
    kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
    worst, ok, rows = 0.0, True, []
    for pos in positions:
        token = (pos * 7919 + 13) % cfg.vocab_size
        out = mk.step(token, pos)
        ref = decode_step(cfg, weights, kref, vref, token, pos)
        r = compare(ref, out)
        r["pos"] = pos
        rows.append(r)
        worst = max(worst, r["rel_l2"])
        good = r["finite"] and r["rel_l2"] <= tol and (r["same_token"] or r["margin"] <= 0.05)
        ok &= good
    kv_err = float((mk.k_cache.float() - kref.float()).abs().max())
    counters_ok = bool((mk.counters() == mk.packed.expected_counters).all())
    ok &= counters_ok and kv_err < 0.05
    RESULTS["checks"].append({"model": name, "schedule": label, "ok": ok, "worst_rel_l2": worst,
                              "kv_max_abs_err": kv_err, "counters_ok": counters_ok, "positions": rows,
                              "occupancy": mk.occupancy.get(("compiled", False))})
    log(f"check {name:9s} {label:32s} {'OK ' if ok else 'FAIL'} worst rel L2 {worst:.2e} kv err {kv_err:.1e} "
        f"counters {'ok' if counters_ok else 'WRONG'} occ {mk.occupancy.get(('compiled', False))}")
    del mk
    return ok


def check_watchdog(cfg: ModelConfig, spec: Any, weights: dict[str, torch.Tensor], kernel: str = "v10") -> None:
    doc = lower(spec, 8, Strategy()).to_json()
    victim = doc["instructions"][len(doc["instructions"]) // 2]
    victim["waits"] = [{"counter": victim["waits"][0]["counter"], "value": 10_000}]
    sched = parse_schedule(doc)
    mk = Megakernel(sched, weights, max_seq_len=spec.max_seq_len, timeout_s=0.5, config=VARIANTS[kernel])
    t = time.time()
    try:
        mk.step(1, 3)
        RESULTS["checks"].append({"model": "tiny", "schedule": f"{kernel} watchdog", "ok": False,
                                  "msg": "no error raised"})
        log(f"check {kernel} watchdog FAIL: no error")
    except WatchdogError as exc:
        dt = time.time() - t
        RESULTS["checks"].append({"model": "tiny", "schedule": f"{kernel} watchdog", "ok": True,
                                  "msg": str(exc)[:400], "seconds": dt})
        log(f"check {kernel} watchdog OK in {dt:.2f} s: {str(exc)[:200]}")


def copy_bandwidth() -> float:
    n = 2 * 1024**3 // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    times.sort()
    del a, b
    return 2 * n * 2 / (times[len(times) // 2] * 1e-3) / 1e12


def stage_spans(trace: dict[str, Any], layers: tuple[int, ...] = (0, 7)) -> str:
    """Per (op, layer) stage: first start, last end, span and the gap since the previous stage ended (µs)."""
    spans: dict[tuple[str, Any], list[float]] = {}
    for e in sorted((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: e["args"]["id"]):
        s = spans.setdefault((e["cat"], e["args"]["layer"]), [1e18, 0.0, 0, 0.0])
        s[0] = min(s[0], e["ts"])
        s[1] = max(s[1], e["ts"] + e["dur"])
        s[2] += 1
        s[3] += e["dur"]
    lines, prev = [], 0.0
    for (op, layer), (a, b, n, d) in spans.items():
        if layer is None or layer in layers:
            lines.append(f"  {op:20s} L{layer}: start {a:8.1f} span {b - a:6.1f} gap {a - prev:5.1f} n {n:4d} "
                         f"mean {d / n:6.2f}")
        prev = b
    return "\n".join(lines)


def _stage_medians(rows: dict[tuple[str, Any], list[tuple[float, ...]]], layers: tuple[int, ...],
                   fmt: str) -> str:
    """One line per (op, layer) of `rows` in `layers` (layerless ops always): the medians of each tuple field,
    formatted by `fmt` (fields m0, m1, ... and n, the instruction count)."""
    lines = []
    for (op, layer), v in rows.items():
        if layer is None or layer in layers:
            meds = {f"m{k}": float(np.median([x[k] for x in v])) for k in range(len(v[0]))}
            lines.append(f"  {op:20s} L{layer}: " + fmt.format(n=len(v), **meds))
    return "\n".join(lines)


def loader_leads(mk: Any, layers: tuple[int, ...] = (7,)) -> tuple[dict[str, Any], str]:
    """v10's ring run-ahead in the last traced step, per (op, layer): medians over the stage's instructions of how
    long before the compute warps started each instruction (after its wait) the loader reached it and issued its
    last fill (µs; negative = the fills were still being issued when it started). Raw rows go to the JSON."""
    p = mk.packed
    raw, lraw = mk.raw_trace(p), mk.raw_loader_trace(p)
    rows: dict[tuple[str, Any], list[tuple[float, ...]]] = {}
    for i, (r, lr) in enumerate(zip(raw, lraw, strict=True)):
        if int(r[2]) and int(lr[1]):
            rows.setdefault((p.ops[i], p.layers[i]), []).append(((int(r[1]) - int(lr[0])) / 1e3,
                                                                 (int(r[1]) - int(lr[1])) / 1e3))
    text = _stage_medians(rows, layers, "loader reached it {m0:6.2f} us before its start, last fill issued "
                                        "{m1:6.2f} us before (n {n})")
    data = {"ids": list(p.ids), "ops": list(p.ops), "layers": list(p.layers), "raw": raw.tolist(),
            "loader_raw": lraw.tolist()}
    return data, text


def phases(mk: Any, layers: tuple[int, ...] = (7,)) -> tuple[dict[str, Any], str]:
    """Where v10's instructions spend their time in the last traced step, per (op, layer): medians over the stage's
    instructions of the stage of the activations (from the wait's end; 0 without one), the op's body after it (the
    ring's slots, the arithmetic, the epilogue's stores) and the signals (their release), µs. Raw rows go to the
    JSON."""
    p = mk.packed
    raw, ph = mk.raw_trace(p), mk.raw_phase_trace(p)
    rows: dict[tuple[str, Any], list[tuple[float, ...]]] = {}
    for i, (r, f) in enumerate(zip(raw, ph, strict=True)):
        start, end, staged, done = int(r[1]), int(r[2]), int(f[0]), int(f[1])
        if end and done:
            staged = staged or start
            rows.setdefault((p.ops[i], p.layers[i]), []).append(((staged - start) / 1e3, (done - staged) / 1e3,
                                                                 (end - done) / 1e3))
    text = _stage_medians(rows, layers, "stage {m0:5.2f} us, body {m1:6.2f}, signals {m2:5.2f} (n {n})")
    return {"phase_raw": ph.tolist()}, text


def floor_bytes(cfg: ModelConfig, ctx: int) -> int:
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ctx * cfg.hd * 2
    return cfg.weight_bytes(2) + kv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", default="128,1024,4096")
    ap.add_argument("--variants", default="base,ns1")
    ap.add_argument("--lowerings", default="naive")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--trace", default="naive", help="lowerings to trace (at ctx 1024, last kernel variant)")
    ap.add_argument("--kernels", default="v10,v9", help="interpreters whose correctness is checked")
    ap.add_argument("--smoke", action="store_true", help="one tiny schedule per --kernels entry, then stop")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    props = torch.cuda.get_device_properties(0)
    env = {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__}
    RESULTS["env"] = env
    log(f"env {env}")
    bw = copy_bandwidth()
    RESULTS["copy_tb_s"] = bw
    log(f"copy bandwidth {bw:.2f} TB/s (read + write)")
    sms = props.multi_processor_count

    kernels = args.kernels.split(",")
    if args.smoke:  # a first look at a new kernel, run under `timeout` before the rest
        spec = get_model("tiny")
        w = {k: v.to("cuda", torch.bfloat16) for k, v in random_weights(spec.config, seed=3).items()}
        if spec.config.tie_word_embeddings:
            w["lm_head"] = w["embed"]
        for kern in kernels:
            try:
                check_model("tiny", spec.config, w, lower(spec, 8), "naive w=8", [40, 41, 42], 40, spec.max_seq_len,
                            kernel=kern)
            except Exception as exc:
                RESULTS["errors"].append(f"smoke {kern}: {exc!r}\n{traceback.format_exc()}")
                log(f"ERROR smoke {kern}: {exc!r}")
                traceback.print_exc()
        (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        return 0 if not RESULTS["errors"] and all(c["ok"] for c in RESULTS["checks"]) else 1

    if not args.skip_correctness:
        for name in ("tiny", "tiny-mha", "tiny-gqa4"):
            spec = get_model(name)
            cfg = spec.config
            w = {k: v.to("cuda", torch.bfloat16) for k, v in random_weights(cfg, seed=3).items()}
            if cfg.tie_word_embeddings:
                w["lm_head"] = w["embed"]
            for kern in kernels:
                try:
                    hist = spec.max_seq_len - 12
                    check_model(name, cfg, w, lower(spec, 8), "naive w=8", list(range(hist, hist + 8)), hist,
                                spec.max_seq_len, kernel=kern)
                    alt = variant_schedule(spec, 5, Strategy(attn_splits=3, k_splits={"o_proj_residual": 2,
                                                                                      "down_proj_residual": 2},
                                                             tiles={"attn_norm_qkv_rope": 32, "o_proj_residual": 8,
                                                                    "mlp_norm_gate_up": 24, "down_proj_residual": 8,
                                                                    "final_norm_lm_head": 40}),
                                           reverse=True, shuffle_counters=7)
                    check_model(name, cfg, w, alt, "rev w=5 splits3 k2 perm", list(range(hist, hist + 8)), hist,
                                spec.max_seq_len, kernel=kern)
                    check_model(name, cfg, w, lower(spec, sms), f"naive w={sms} from pos 0", list(range(0, 6)), 0,
                                spec.max_seq_len, kernel=kern)
                    if not isinstance(VARIANTS[kern], KernelConfig):  # v9 computes whole QKV heads only
                        pairs = lower(spec, 7, Strategy(attn_splits=2, tiles={"attn_norm_qkv_rope": 10},
                                                        default_granularity="head"))
                        check_model(name, cfg, w, pairs, "qkv pair tiles 10 w=7 head", list(range(hist, hist + 4)),
                                    hist, spec.max_seq_len, kernel=kern)
                        fused = lower(spec, 7, Strategy(attn_splits=3, fuse_attn_reduce=True,
                                                        k_splits={"o_proj_residual": 2}, default_granularity="head"))
                        check_model(name, cfg, w, fused, "attn_reduce_o_proj k2 w=7 head",
                                    list(range(hist, hist + 4)), hist, spec.max_seq_len, kernel=kern)
                    if name == "tiny":
                        check_watchdog(cfg, spec, w, kernel=kern)
                except Exception as exc:  # keep going: every other check still runs
                    RESULTS["errors"].append(f"{name} {kern}: {exc!r}\n{traceback.format_exc()}")
                    log(f"ERROR {name} {kern}: {exc!r}")
                    traceback.print_exc()

    spec = get_model("llama-1b")
    cfg = spec.config
    t = time.time()
    w = gpu_random_weights(cfg)
    torch.cuda.synchronize()
    log(f"llama-1b weights in {time.time() - t:.1f} s")
    if not args.skip_correctness:
        try:
            n = 4 if args.quick else 8
            for kern in kernels:
                check_model("llama-1b", cfg, w, lower(spec, sms), f"naive w={sms}", list(range(2048, 2048 + n)),
                            2048, spec.max_seq_len, kernel=kern)
                alt = variant_schedule(spec, sms, Strategy(attn_splits=4, k_splits={"o_proj_residual": 2,
                                                                                    "down_proj_residual": 2}),
                                       reverse=True, shuffle_counters=3)
                check_model("llama-1b", cfg, w, alt, "rev splits4 k2 perm", list(range(3000, 3000 + n // 2)), 3000,
                            spec.max_seq_len, kernel=kern)
        except Exception as exc:
            RESULTS["errors"].append(f"llama-1b: {exc!r}\n{traceback.format_exc()}")
            log(f"ERROR llama-1b: {exc!r}")
            traceback.print_exc()

    variants = VARIANTS
    tiles = {"embed": 1 << 20, "attn_norm_qkv_rope": 64, "o_proj_residual": 16, "mlp_norm_gate_up": 16,
             "down_proj_residual": 16, "final_norm_lm_head": 256}
    gu32 = {**tiles, "mlp_norm_gate_up": 32}
    best = {**tiles, "mlp_norm_gate_up": 64, "final_norm_lm_head": 1024}  # + 16 splits: bench/best_schedule_...

    searched = {**tiles, "attn_norm_qkv_rope": 32, "o_proj_residual": 64, "mlp_norm_gate_up": 64,
                "down_proj_residual": 64}
    sk4 = {"o_proj_residual": 4, "down_proj_residual": 4}

    def strat(**kw: Any) -> Strategy:
        return Strategy(**kw)

    lowerings = {
        "naive": lambda: strat(),
        "split4": lambda: strat(attn_splits=4),
        "gu32": lambda: strat(tiles=gu32, attn_splits=4),
        "gu64": lambda: strat(tiles={**tiles, "mlp_norm_gate_up": 64}, attn_splits=4),
        "lm1k": lambda: strat(tiles={**gu32, "final_norm_lm_head": 1024}, attn_splits=4),
        "gu64lm": lambda: strat(tiles={**tiles, "mlp_norm_gate_up": 64, "final_norm_lm_head": 1024}, attn_splits=4),
        "gu64s8": lambda: strat(tiles={**tiles, "mlp_norm_gate_up": 64}, attn_splits=8),
        "gu128": lambda: strat(tiles={**tiles, "mlp_norm_gate_up": 128}, attn_splits=4),
        "best": lambda: strat(tiles=best, attn_splits=16),  # the best hand-written schedule
        "best_s8": lambda: strat(tiles=best, attn_splits=8),  # the best hand-written schedule with 8 attention splits
        "best_lm972": lambda: strat(tiles={**best, "final_norm_lm_head": 972}, attn_splits=16),  # one wave of 132
        # QKV tiles of RoPE pairs (v10): 96 / 128 instructions per layer instead of 48 whole heads
        "best_q32": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32}, attn_splits=16),
        "best_q24": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 24}, attn_splits=16),
        # around best_q32, for the heuristic seeds of the v10 search
        "q32_s8": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32}, attn_splits=8),
        "q32_o32": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "o_proj_residual": 32}, attn_splits=16),
        "q32_gu32": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 32}, attn_splits=16),
        "q32_gu128": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "mlp_norm_gate_up": 128},
                                   attn_splits=16),
        "q32_d32k2": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "down_proj_residual": 32},
                                   attn_splits=16, k_splits={"down_proj_residual": 2}),
        "q32_lm972": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "final_norm_lm_head": 972},
                                   attn_splits=16),
        "q32_head": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32}, attn_splits=16,
                                  edges={"attn_partial->attn_reduce": "head", "attn_reduce->o_proj_residual": "head",
                                         "attn_norm_qkv_rope->attn_partial": "head"}),
        "best_o32": lambda: strat(tiles={**best, "o_proj_residual": 32}, attn_splits=8),
        "best_d32k2": lambda: strat(tiles={**best, "down_proj_residual": 32}, attn_splits=8,
                                    k_splits={"o_proj_residual": 1, "down_proj_residual": 2}),
        # the searched best (runs/llama-1b-noseed-h200) and attn_reduce folded into o_proj around it
        "searched": lambda: strat(tiles=searched, attn_splits=16, k_splits=sk4),
        "searched_fused": lambda: strat(tiles=searched, attn_splits=16, k_splits=sk4, fuse_attn_reduce=True),
        "searched_fused_head": lambda: strat(tiles=searched, attn_splits=16, k_splits=sk4, fuse_attn_reduce=True,
                                             edges={"attn_partial->attn_reduce_o_proj": "head"}),
        "searched_fused_k2": lambda: strat(tiles=searched, attn_splits=16, fuse_attn_reduce=True,
                                           k_splits={**sk4, "o_proj_residual": 2}),
        "searched_fused_k8": lambda: strat(tiles=searched, attn_splits=16, fuse_attn_reduce=True,
                                           k_splits={**sk4, "o_proj_residual": 8}),
        "searched_fused_s8": lambda: strat(tiles=searched, attn_splits=8, k_splits=sk4, fuse_attn_reduce=True),
        # the searched best on the first-warp-poll kernel (bench/runs/llama-1b-h200, c0027), and with per-head waits
        # from QKV to attention and from attention to the merge + o_proj
        "lead_best": lambda: strat(tiles=searched, attn_splits=16, k_splits=sk4, fuse_attn_reduce=True,
                                   assignment="critical_path"),
        "lead_best_head": lambda: strat(tiles=searched, attn_splits=16, k_splits=sk4, fuse_attn_reduce=True,
                                        assignment="critical_path",
                                        edges={"attn_norm_qkv_rope->attn_partial": "head",
                                               "attn_partial->attn_reduce_o_proj": "head"}),
        "q32_d32k2_fused": lambda: strat(tiles={**best, "attn_norm_qkv_rope": 32, "down_proj_residual": 32},
                                         attn_splits=16, k_splits={"down_proj_residual": 2, "o_proj_residual": 4},
                                         fuse_attn_reduce=True),
        "chunk": lambda: strat(tiles=gu32, attn_splits=4, default_granularity="chunk"),
        "head": lambda: strat(tiles=gu32, attn_splits=4, default_granularity="head"),
        "chunk_cb": lambda: strat(tiles=gu32, attn_splits=4, default_granularity="chunk", assignment="cost_balanced"),
        "chunk_cp": lambda: strat(tiles=gu32, attn_splits=4, default_granularity="chunk", assignment="critical_path",
                                  order="critical_path"),
        "tile": lambda: strat(tiles=gu32, attn_splits=4, default_granularity="tile"),
    }
    ctxs = [int(c) for c in args.ctx.split(",")]
    mk = None
    for vname in args.variants.split(","):
        kcfg = variants[vname]
        for lname in args.lowerings.split(","):
            try:
                t = time.time()
                sched = lower(spec, sms, lowerings[lname]())
                if mk is None or mk.kcfg != kcfg:
                    del mk
                    torch.cuda.empty_cache()
                    mk = Megakernel(sched, w, max_seq_len=spec.max_seq_len, config=kcfg)
                    gen = torch.Generator(device="cuda").manual_seed(5)
                    mk.k_cache.normal_(generator=gen)
                    mk.v_cache.normal_(generator=gen)
                mk.set_schedule(sched)
                kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
                got = mk.step(77, 1500)
                ref = decode_step(cfg, w, kref, vref, 77, 1500)
                cmp = compare(ref, got)
                RESULTS["checks"].append({"model": "llama-1b", "schedule": f"{vname}/{lname} pos 1500",
                                          "ok": cmp["rel_l2"] <= 2e-2 and cmp["finite"],
                                          "worst_rel_l2": cmp["rel_l2"]})
                del kref, vref
                for ctx in ctxs:
                    r = time_schedule(mk, sched, ctx, reps=args.reps)
                    nbytes = floor_bytes(cfg, ctx)
                    r.update({"variant": vname, "lowering": lname, "kernel_config": dataclasses.asdict(kcfg),
                              "bytes": nbytes, "achieved_tb_s": nbytes / (r["median_ms"] * 1e-3) / 1e12,
                              "floor_ms": nbytes / (bw * 1e12) * 1e3, "check_rel_l2": cmp["rel_l2"],
                              "occupancy": mk.occupancy.get(("compiled", False))})
                    RESULTS["timings"].append(r)
                    log(f"time {vname:7s} {lname:8s} ctx {ctx:5d}: {r['median_ms']:.3f} ms (p10 {r['p10_ms']:.3f} "
                        f"p90 {r['p90_ms']:.3f}) {r['achieved_tb_s']:.2f} TB/s rel {cmp['rel_l2']:.1e} "
                        f"[{time.time() - t:.0f}s]")
            except Exception as exc:
                RESULTS["errors"].append(f"timing {vname}/{lname}: {exc!r}\n{traceback.format_exc()}")
                log(f"ERROR timing {vname}/{lname}: {exc!r}")
                traceback.print_exc()

    if mk is not None:
        for lname in [t for t in args.trace.split(",") if t in lowerings]:
            try:
                mk.set_schedule(lower(spec, sms, lowerings[lname]()))
                tr = mk.traced_step(1, 1023, {"model": "llama-1b", "ctx": 1024, "lowering": lname,
                                              "kernel_config": dataclasses.asdict(mk.kcfg)})
                write_trace(out / f"trace_{lname}.json", tr)
                summ = summarize(tr)
                RESULTS.setdefault("trace_summary", {})[lname] = {k: v for k, v in summ.items() if k != "per_sm"}
                log(f"trace {lname}: " + format_summary(summ))
                log(stage_spans(tr))
                if isinstance(mk.kcfg, StreamConfig):
                    ldata, ltext = loader_leads(mk)
                    pdata, ptext = phases(mk)
                    (out / f"loader_{lname}.json").write_text(json.dumps({**ldata, **pdata}))
                    log(ltext)
                    log(ptext)
                    RESULTS.setdefault("phases", {})[lname] = ptext
            except Exception as exc:
                RESULTS["errors"].append(f"trace: {exc!r}\n{traceback.format_exc()}")
                log(f"ERROR trace: {exc!r}")

    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    log("\n=== summary ===")
    for c in RESULTS["checks"]:
        log(f"{'PASS' if c['ok'] else 'FAIL'} {c['model']:9s} {c['schedule']:32s} "
            f"{c.get('worst_rel_l2', float('nan')):.2e}")
    for r in RESULTS["timings"]:
        log(f"{r['variant']:7s} {r['lowering']:7s} ctx {r['ctx']:5d} {r['median_ms']:.3f} ms "
            f"[{r['p10_ms']:.3f},{r['p90_ms']:.3f}] {r['achieved_tb_s']:.2f} TB/s floor {r['floor_ms']:.3f} ms")
    log(f"errors: {len(RESULTS['errors'])}")
    return 0 if not RESULTS["errors"] and all(c["ok"] for c in RESULTS["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
