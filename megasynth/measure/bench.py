"""`synth bench`: the decode step's time for the PyTorch baselines, the per-op ablation and the megakernel, side by
side with the bandwidth floor, measured in one process on one GPU (CUDA events, warm-up, spread; torch.compile in a
bounded child process) and written as one JSON document (format `megasynth-bench/1`).

The floor is the bytes a decode step must move (weights once, the KV history read, the new K/V and the logits
written) divided by the device-to-device copy bandwidth measured in the same run (bytes read + written). The
position decoded is pos = ctx - 1, so attention covers exactly ctx positions; the KV cache is pre-filled with random
data (no need to decode ctx tokens). The weights (2.47 GB for llama-1b) exceed the L2 (60 MB on the H200) many times
over, so consecutive steps evict each other's weights; `flush_l2` additionally overwrites a buffer of twice the L2
between timed repetitions (outside the timed region), which also evicts the KV cache and activations.

Every ratio is against the best PyTorch step of the same ctx (`pytorch_best`): the fastest PyTorch variant whose
logits are within PYTORCH_TOL of the fp32 reference's with the same greedy token (bf16 rounding passes, a wrong step
does not), in practice the bf16 step in a CUDA graph or its torch.compile.

At `batch` B > 1 every sequence sits at the same ctx with its own random KV history and token; the reference is
`decode_batch` (each sequence alone), the floor counts the weights once and each sequence's KV history, new K/V and
logits, and every variant's `tokens_per_s` is B / its step time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from megasynth.ir.schedule_set import ScheduleSet
from megasynth.lowering.models import BatchError, MaxSeqLenError, ModelSpec, get_model, with_batch
from megasynth.measure.compile import run_compile
from megasynth.measure.options import FORMAT, BenchError, BenchOptions, ScheduleRejected
from megasynth.measure.timing import device_info, floor_bytes, measure_copy_bandwidth, schedule_bytes, versions
from megasynth.measure.torch_step import CHECK_TOL, PYTORCH_TOL, check_ok, prefill
from megasynth.measure.variants import PYTORCH, VARIANTS, default_variants, new_state, reference_step, run_variant


def load_bench_schedule(spec: ModelSpec, path: str | None, verify: bool) -> tuple[Any, dict[str, Any]]:
    """The schedule to run (a .json or .json.gz file; default: the naive lowering for the SM count), or a schedule set
    (one schedule per context range: each ctx runs the member whose range holds pos = ctx - 1), and a summary for the
    JSON (a sha256 is of the JSON text, compressed or not)."""
    from megasynth.ir.schedule import decode_json, parse_schedule, read_file_text
    from megasynth.ir.schedule_set import is_schedule_set, parse_schedule_set

    if path is None:
        from megasynth.lowering.lower import lower

        workers = 132
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                workers = torch.cuda.get_device_properties(0).multi_processor_count
        schedule = lower(spec, workers)
        text = json.dumps(schedule.to_json(), sort_keys=True)
        info: dict[str, Any] = {"path": None,
                                "source": f"naive lowering (megasynth.lowering.lower.lower, {workers} workers)"}
        return _checked(spec, schedule, text, None, verify, info), info
    text = read_file_text(path)
    data = decode_json(text, path)
    if not is_schedule_set(data):
        info = {"path": path, "source": "file"}
        return _checked(spec, parse_schedule(data, path), text, path, verify, info), info
    sset = parse_schedule_set(data, path)
    members = []
    for (lo, hi), sched, member in zip(sset.ranges(), sset.schedules, sset.files, strict=True):
        rec: dict[str, Any] = {"positions": [lo, hi], "path": member}
        _checked(spec, sched, read_file_text(member), member, verify, rec)
        members.append(rec)
    return sset, {"path": path, "source": "schedule set (the member whose range holds pos = ctx - 1 runs each ctx)",
                  "sha256": hashlib.sha256(text.encode()).hexdigest(), "members": members}


def _checked(spec: ModelSpec, schedule: Any, text: str, path: str | None, verify: bool,
             info: dict[str, Any]) -> Any:
    """Check that a schedule decodes `spec` (config, max_seq_len, batch) and, with `verify`, passes the validator's
    structure, coverage and deadlock phases; record its summary in `info`."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.ir.model import ModelConfig

    if path is not None:
        if schedule.model is None:
            raise ScheduleError("the schedule has no `model`; only catalogue-op schedules can run", "$.model", path)
        if ModelConfig.from_hf(schedule.model.config) != spec.config:
            raise ScheduleError(f"the schedule's model config is not {spec.name}'s", "$.model.config", path)
        if schedule.model.max_seq_len != spec.max_seq_len:
            raise ScheduleError(f"max_seq_len {schedule.model.max_seq_len} differs from {spec.name}'s "
                                f"{spec.max_seq_len} (give --max-seq-len {schedule.model.max_seq_len})",
                                "$.model.max_seq_len", path)
        if (schedule.model.batch or 1) != spec.batch:
            raise ScheduleError(f"the schedule decodes batch {schedule.model.batch or 1}, not {spec.batch} "
                                f"(give --batch {schedule.model.batch or 1})", "$.model.batch", path)
    info.update(sha256=hashlib.sha256(text.encode()).hexdigest(), instructions=len(schedule.instructions),
                workers=len(schedule.queues), counters=schedule.counters,
                proposer=(schedule.meta or {}).get("proposer") if isinstance(schedule.meta, dict) else None)
    if verify:
        from megasynth.validator.verify import Options
        from megasynth.validator.verify import verify as run_verify

        report = run_verify(schedule, path, Options(races=False))
        info["validation"] = {"verdict": report.verdict, "phases": "structure, coverage, deadlock (race proofs: "
                              "run `validate`)", "findings": [f.message for f in report.findings[:3]]}
        if not report.accepted:
            raise ScheduleRejected(f"{path or 'the schedule'}: rejected by the validator: {report.findings[0].message}")
    return schedule


def pytorch_best(variants: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest PyTorch variant of one ctx whose logits are the reference's to bf16 precision (PYTORCH_TOL, same
    greedy token), or None if none is."""
    best = None
    for name in PYTORCH:
        rec = variants.get(name, {})
        check = rec.get("check") or {}
        if rec.get("status") != "ok" or not check_ok(check, PYTORCH_TOL) or not check.get("argmax_match"):
            continue
        ms = rec["timing"]["median_ms"]
        if best is None or ms < best["median_ms"]:
            best = {"variant": name, "label": rec.get("label", name), "median_ms": ms}
    return best


def add_ratios(ctx_rec: dict[str, Any], copy_tbps: float) -> None:
    """Fill the floor, `pytorch_best` and the ratio fields of one ctx's variants from their measured medians
    (nothing is estimated): speedup_vs_pytorch_best = best PyTorch time / this time, x_floor = this time / floor,
    pct_copy_bw = floor / this time (the floor is at the copy bandwidth), tokens_per_s = the ctx record's batch
    (1 when absent) / this time."""
    batch = ctx_rec.get("batch", 1)
    floor = ctx_rec["floor"]
    floor["ms"] = floor["bytes"]["total"] / (copy_tbps * 1e12) * 1e3
    variants = ctx_rec["variants"]
    best = pytorch_best(variants)
    ctx_rec["pytorch_best"] = best
    graph = variants.get("torch_graph", {})
    graph_ms = graph["timing"]["median_ms"] if graph.get("status") == "ok" else None
    for rec in variants.values():
        if rec.get("status") != "ok":
            continue
        ms = rec["timing"]["median_ms"]
        rec["speedup_vs_pytorch_best"] = best["median_ms"] / ms if best else None
        rec["speedup_vs_graph"] = graph_ms / ms if graph_ms else None  # against the fp32-upcasting reference graph
        rec["x_floor"] = ms / floor["ms"]
        rec["achieved_tbps"] = floor["bytes"]["total"] / (ms * 1e-3) / 1e12
        rec["pct_copy_bw"] = 100.0 * floor["ms"] / ms
        rec["tokens_per_s"] = batch / (ms * 1e-3)
    for name in ("per_op_graph", "megakernel"):  # bytes the schedule moves by the catalogue's own accounting
        rec = variants.get(name, {})
        if rec.get("status") == "ok" and ctx_rec.get("schedule_bytes"):
            rec["schedule_tbps"] = ctx_rec["schedule_bytes"] / (rec["timing"]["median_ms"] * 1e-3) / 1e12


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure every wanted variant at every ctx; returns the JSON-ready result."""
    import torch

    try:
        spec = with_batch(get_model(opts.model, opts.max_seq_len), opts.batch)
    except (MaxSeqLenError, BatchError) as exc:
        raise BenchError(str(exc)) from None
    bad = [c for c in opts.ctxs if not 1 <= c <= spec.max_seq_len]
    if bad:
        raise BenchError(f"--ctx {bad[0]} must be in [1, {spec.max_seq_len}] for {spec.name} (its max_seq_len; "
                         f"raise it with --max-seq-len)")
    unknown = [v for v in opts.variants or [] if v not in VARIANTS]
    if unknown:
        raise BenchError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    if not 0 <= opts.token < spec.config.vocab_size:
        raise BenchError(f"--token {opts.token} is outside the vocabulary [0, {spec.config.vocab_size})")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("CUDA is not available; use --dry-run to exercise the command on the CPU")
    wanted = set(opts.variants if opts.variants is not None else default_variants(opts.device))
    t0 = time.perf_counter()
    schedule, sched_info = load_bench_schedule(spec, opts.schedule, opts.verify)
    dev = device_info(opts.device)
    log(f"{dev['name']}: copy bandwidth")
    copy = measure_copy_bandwidth(opts.device, opts.copy_bytes if opts.device == "cuda" else 1 << 26)
    log(f"copy bandwidth {copy['tbps']:.3f} TB/s; building weights")
    st = new_state(spec, opts)
    st.schedule = st.schedules = schedule
    between = None
    if opts.flush_l2 and opts.device == "cuda":
        scratch = torch.empty(max(2 * (dev.get("l2_bytes") or 0), 1 << 27), dtype=torch.uint8, device="cuda")
        between = scratch.zero_
    result: dict[str, Any] = {
        "format": FORMAT, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["synth", *sys.argv[1:]]) if sys.argv else None,
        "model": spec.name, "config": spec.config.to_hf(), "max_seq_len": spec.max_seq_len, "batch": spec.batch,
        "device": dev, "versions": versions(), "dry_run": opts.device != "cuda",
        "settings": {"reps": opts.reps, "warmup": opts.warmup, "seed": opts.seed, "weights": opts.weights_dir,
                     "token": opts.token, "tokens": st.tokens, "variants": [v for v in VARIANTS if v in wanted],
                     "dtype": "bfloat16 weights and KV cache", "flush_l2": opts.flush_l2,
                     "timer": "CUDA events per repetition" if opts.device == "cuda" else "perf_counter",
                     "position": "pos = ctx - 1 (attention over ctx positions), random KV history"
                                 + (f"; each of the {spec.batch} sequences at the same ctx with its own history and "
                                    "token" if spec.batch > 1 else ""),
                     "check_tolerance": CHECK_TOL, "pytorch_best_tolerance": PYTORCH_TOL,
                     "compile_timeout_s": opts.compile_timeout_s, "compile_mode": opts.compile_mode,
                     "kernel_options": list(opts.kernel_options),
                     "weights_over_l2": (floor_bytes(spec.config, 1)["weights"] / dev["l2_bytes"]
                                         if dev.get("l2_bytes") else None)},
        "schedule": sched_info, "copy_bandwidth": copy, "results": [],
    }
    for ctx in opts.ctxs:
        st.ctx = ctx
        if isinstance(schedule, ScheduleSet):  # the member whose range holds pos = ctx - 1
            st.schedule = schedule.pick(ctx - 1)
        hist = st.history(opts.seed)
        prefill(st.k, st.v, hist)
        with torch.inference_mode():
            ref = reference_step(st)()
        rec: dict[str, Any] = {"ctx": ctx, "pos": st.pos, "batch": spec.batch,
                               "floor": {"bytes": floor_bytes(spec.config, ctx, spec.batch)},
                               "schedule_bytes": schedule_bytes(st.schedule, ctx), "variants": {}}
        if isinstance(schedule, ScheduleSet):
            rec["schedule_member"] = schedule.index(ctx - 1)
        for name in VARIANTS:
            if name == "torch_compile" or name not in wanted:
                continue
            prefill(st.k, st.v, hist)
            rec["variants"][name] = run_variant(name, st, opts, ref, between, log)
        result["results"].append(rec)
    if "torch_compile" in wanted:
        del st  # the child needs the GPU memory more than we do now
        if opts.device == "cuda":
            torch.cuda.empty_cache()
        compiled = run_compile(opts, log)
        for rec in result["results"]:
            rec["variants"]["torch_compile"] = compiled[rec["ctx"]]
    for rec in result["results"]:
        rec["variants"] = {k: rec["variants"][k] for k in VARIANTS if k in rec["variants"]}
        add_ratios(rec, copy["tbps"])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def split_by_ctx(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """One document per ctx, each the whole result with only that ctx's row (a results table's row per file)."""
    return {rec["ctx"]: {**result, "results": [rec]} for rec in result["results"]}
