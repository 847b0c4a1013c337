"""torch.compile of the bf16 step in a child process, so that a long max-autotune compile or a hang is bounded by
killing it: the parent (`run_compile`) starts `python -m megasynth.measure.compile --compile-worker OPTIONS_JSON`,
which builds its own weights, compiles and times the step at every ctx and prints one tagged JSON line per ctx."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from megasynth.lowering.models import get_model, with_batch
from megasynth.measure.options import BenchOptions
from megasynth.measure.timing import capture_graph, time_fn
from megasynth.measure.torch_step import (
    bf16_decode_batch,
    bf16_decode_step,
    bf16_rope,
    compare,
    kv_write_index,
    prefill,
    step_weights,
)
from megasynth.measure.variants import VARIANTS, State, batch_token_ids, new_state, reference_step, short_error

RESULT_TAG = "@@BENCH "  # prefix of the worker's result lines on stdout
NAME = "torch_compile"
INDUCTOR_GRAPHS = ("max-autotune", "reduce-overhead")


def compile_worker(opts: BenchOptions, emit: Callable[[dict[str, Any]], None]) -> None:
    """Child side: compile the bf16 step and time it at every ctx (captured in a CUDA graph on the GPU); emits one
    result dict per ctx as soon as it has it, so a later kill keeps the earlier ctx values."""
    import torch

    spec = with_batch(get_model(opts.model, opts.max_seq_len), opts.batch)
    st = new_state(spec, opts)
    label, launch = VARIANTS[NAME]
    # modes with inductor's own CUDA graphs (cudagraph trees) replay those; the others are captured in one of ours
    own_graphs = opts.compile_mode in INDUCTOR_GRAPHS and opts.device == "cuda"
    for ctx in opts.ctxs:
        st.ctx = ctx
        prefill(st.k, st.v, st.history(opts.seed))
        rec: dict[str, Any] = {"ctx": ctx, "label": label, "launch": launch}
        try:
            with torch.inference_mode():
                ref = reference_step(st)()
                step_fn, statics = compiled_step(st)
                if own_graphs:  # else cudagraph trees copy every weight into their own buffers at each replay
                    for t in statics:
                        torch._dynamo.mark_static_address(t)
                fn = compile_step(step_fn, opts.compile_mode, opts.compile_backend)
                t = time.perf_counter()
                for _ in range(3 if own_graphs else 1):  # compiles (and autotunes) here; cudagraph trees record late
                    out = fn()
                if opts.device == "cuda":
                    torch.cuda.synchronize()
                rec["compile_s"] = round(time.perf_counter() - t, 3)
                step = capture_graph(fn) if opts.device == "cuda" and not own_graphs else fn
                rec["check"] = compare(step(), ref)
                rec["check_uncaptured"] = compare(out, ref)
                rec["timing"] = time_fn(step, reps=opts.reps, warmup=opts.warmup, device=opts.device)
            rec["dynamo"] = dynamo_stats()  # the timed calls compiled nothing more
            rec["status"] = "ok"
            how = ("inductor's CUDA graphs" if own_graphs else "captured in a CUDA graph" if opts.device == "cuda"
                   else "no CUDA graph on the CPU")
            rec["note"] = (f"mode={opts.compile_mode}, backend={opts.compile_backend}, static shapes (one graph per "
                           f"ctx), K/V written in place by index_put_; {how}"
                           + (f"; the {st.batch} sequences in one step" if st.batch > 1 else ""))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            rec.update(status="failed", reason=short_error(exc))
        emit(rec)


def compiled_step(st: State) -> tuple[Callable[[], Any], list[Any]]:
    """The bf16 step at the state's position as torch.compile is given it, and every tensor it reads (all at fixed
    addresses: weights laid out once per run, the caches, RoPE and the K/V write index made once per ctx). The same
    math as the plain step; only the K/V write is an index_put_ (`bf16_decode_step`'s `kv_at`) so that the compiled
    step updates the caches in place instead of copying them whole. A batch > 1 compiles `bf16_decode_batch` (its
    token ids are one more fixed tensor)."""
    if st.step_weights is None:
        st.step_weights = step_weights(st.cfg, st.weights)
    w, cfg, k, v, token, pos = st.step_weights, st.cfg, st.k, st.v, st.token, st.pos
    cos, sin = bf16_rope(cfg, pos, st.device)
    kv_at = kv_write_index(cfg, pos, st.device)
    statics = [*static_tensors(st), cos, sin, *kv_at]
    if st.batch > 1:
        ids = batch_token_ids(st)
        return (lambda: bf16_decode_batch(cfg, w, k, v, ids, pos, cos, sin, kv_at)), [*statics, ids]
    return (lambda: bf16_decode_step(cfg, w, k, v, token, pos, cos, sin, kv_at)), statics


def compile_step(step_fn: Callable[[], Any], mode: str | None, backend: str | Callable[..., Any]) -> Callable[[], Any]:
    """torch.compile of one ctx's step from a clean dynamo state, with static shapes: the position is a constant of
    the graph (the attention reads exactly ctx rows), so each ctx gets one graph of its own, never counted as a
    recompile of the previous ctx's nor turned into a dynamic-shape graph by automatic dynamic shapes."""
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(step_fn, mode=mode, backend=backend, dynamic=False)


def dynamo_stats() -> dict[str, int]:
    """Graphs dynamo made and graph breaks it hit since `compile_step` (one graph and no break is the healthy
    compile; a graph per call would be a recompile per step)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def static_tensors(st: State) -> list[Any]:
    """The tensors whose addresses never change: the KV caches and the bf16 step's weights."""
    w = st.step_weights
    assert w is not None, "the weights are laid out first (bf16_step_fn or compiled_step)"
    return [st.k, st.v, *w.tensors()]


def run_compile(opts: BenchOptions, log: Callable[[str], None]) -> dict[int, dict[str, Any]]:
    """Parent side: run `compile_worker` in a child process (own session) for at most compile_timeout_s seconds.
    Ctx values it did not finish are `timed_out` (killed at the limit) or `failed` (the child died)."""
    label, launch = VARIANTS[NAME]
    base = {"label": label, "launch": launch}
    if opts.device != "cuda" and opts.compile_backend == "inductor":
        return {c: {**base, "status": "skipped", "reason": "no CUDA (dry run)"} for c in opts.ctxs}
    log(f"torch.compile ({opts.compile_mode}) in a child process (limit {opts.compile_timeout_s:.0f} s)")
    payload = json.dumps(asdict(opts))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where megasynth/ lies
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "megasynth.measure.compile", "--compile-worker", payload],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=opts.compile_timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    results: dict[int, dict[str, Any]] = {}
    for line in (out or "").splitlines():
        if line.startswith(RESULT_TAG):
            rec = json.loads(line[len(RESULT_TAG):])
            results[rec.pop("ctx")] = rec
    tail = (err or "").strip().splitlines()
    if timed_out:
        status, why = "timed_out", f"compile + timing exceeded the {opts.compile_timeout_s:.0f} s limit (child killed)"
    else:
        status, why = "failed", f"child exited with code {proc.returncode}: {tail[-1][:200] if tail else 'no output'}"
    for c in opts.ctxs:
        results.setdefault(c, {**base, "status": status, "reason": why})
    return results


def main(argv: list[str]) -> int:
    """`python -m megasynth.measure.compile --compile-worker OPTIONS_JSON`: the child process of `run_compile`."""
    if len(argv) != 2 or argv[0] != "--compile-worker":
        print("usage: python -m megasynth.measure.compile --compile-worker OPTIONS_JSON", file=sys.stderr)
        return 2
    opts = BenchOptions(**json.loads(argv[1]))
    if opts.device == "cpu":  # the dry run's tiny ops: one thread avoids OpenMP spin contention
        import torch

        torch.set_num_threads(1)

    def emit(rec: dict[str, Any]) -> None:
        print(RESULT_TAG + json.dumps(rec), flush=True)

    compile_worker(opts, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
