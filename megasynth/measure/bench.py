"""`synth bench`: the decode step's time for every baseline, the per-op ablation and the megakernel, side by side with
the bandwidth floor, measured in one process on one GPU (CUDA events, warm-up, spread) and written as one JSON file.

Variants (every one decodes the same token at the same position over the same random KV history and weights, and its
logits are checked against the eager reference before its time is reported):

  torch_eager    kernels.reference.decode_step on the GPU (bf16 weights and KV cache; the reference computes in fp32)
  torch_graph    the same step captured in one CUDA graph and replayed
  torch_bf16     a bf16-native PyTorch step (matvecs in bf16, fp32 accumulate) in a CUDA graph: what a serving engine
                 does, and so the fair "PyTorch" line (the reference upcasts every weight matrix to fp32 each step)
  hf_eager       transformers' LlamaForCausalLM, bf16, same weights, DynamicCache pre-filled to ctx
  torch_compile  torch.compile(mode="reduce-overhead") of the reference step, in a child process with a time limit
  per_op_graph   the no-megakernel ablation: one launch of the persistent interpreter per stage (all instructions of
                 one op in one layer, no counters), the launches captured in one CUDA graph
  megakernel     the persistent interpreter running the whole schedule (default: the naive lowering)
  cpu_executor   dry run without CUDA only: the schedule on kernels.cpu_executor (tests the command's plumbing)

The floor is the bytes a decode step must move (weights once, the KV history read, the new K/V and the logits
written) divided by the device-to-device copy bandwidth measured in the same run (bytes read + written).
The position decoded is pos = ctx - 1, so attention covers exactly ctx positions; the KV cache is pre-filled with
random data (no need to decode ctx tokens). The weights (2.47 GB for llama-1b) exceed the L2 (60 MB on the H200)
many times over, so consecutive steps evict each other's weights; `flush_l2` additionally overwrites a buffer of
twice the L2 between timed repetitions (outside the timed region), which also evicts the KV cache and activations.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from megasynth.ir.catalogue import ACT_BYTES, OPS, W_BYTES
from megasynth.ir.model import ModelConfig
from megasynth.lowering.models import ModelSpec, get_model

FORMAT = "megasynth-bench/1"
RESULT_TAG = "@@BENCH "  # prefix of the compile worker's result lines on stdout

#: name -> (label, how it is launched); the order is the table's order.
VARIANTS: dict[str, tuple[str, str]] = {
    "torch_eager": ("PyTorch eager (reference)", "eager: one launch per torch op"),
    "torch_graph": ("PyTorch + CUDA graph (reference)", "CUDA graph replay"),
    "torch_bf16": ("PyTorch bf16-native + CUDA graph", "CUDA graph replay"),
    "hf_eager": ("HF transformers eager", "eager: one launch per torch op"),
    "torch_compile": ("torch.compile reduce-overhead", "inductor kernels, CUDA graph replay (cudagraph trees)"),
    "per_op_graph": ("per-op Triton launches + CUDA graph", "one interpreter launch per stage, CUDA graph replay"),
    "megakernel": ("megakernel (schedule)", "CUDA graph replay: counter reset + persistent kernel"),
    "cpu_executor": ("schedule on CPU executor (dry run)", "Python interpreter of the schedule"),
}
GPU_ONLY = {"torch_graph", "torch_bf16", "torch_compile", "per_op_graph", "megakernel"}
BASELINE = "torch_graph"  # ratios "vs graph" are against this one (the CUDA-graph PyTorch step)


class BenchError(Exception):
    """Bad input or an unusable environment; the CLI prints it as one line."""


class Skip(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A variant cannot run here; the message says why (it is reported as `skipped: reason`)."""


@dataclass
class BenchOptions:
    """What to measure. `device` is "cuda" or "cpu" (the dry run)."""

    model: str = "llama-1b"
    schedule: str | None = None
    ctxs: list[int] = field(default_factory=lambda: [1024])
    reps: int = 100
    warmup: int = 10
    seed: int = 0
    weights_dir: str | None = None  # a Hugging Face checkpoint folder; None = random weights from `seed`
    token: int = 1
    device: str = "cuda"
    variants: list[str] | None = None  # None = every variant
    compile_timeout_s: float = 300.0
    compile_backend: str = "inductor"  # "eager" skips inductor (tests use it to exercise the worker quickly)
    compile_mode: str | None = "reduce-overhead"
    flush_l2: bool = False
    copy_bytes: int = 1 << 30
    verify: bool = True

    def wanted(self, name: str) -> bool:
        return self.variants is None or name in self.variants


# --------------------------------------------------------------------------------------------------------------
# Statistics and timing


def summarize(samples_ms: list[float]) -> dict[str, float | int]:
    """Median, p10/p90 (linear interpolation), min, max and mean of per-repetition times in ms."""
    if not samples_ms:
        raise ValueError("no samples")
    xs = sorted(samples_ms)

    def q(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": xs[0], "max_ms": xs[-1],
            "mean_ms": sum(xs) / len(xs), "reps": len(xs)}


def time_fn(fn: Callable[[], Any], *, reps: int, warmup: int, device: str,
            between: Callable[[], None] | None = None) -> dict[str, float | int]:
    """Time `fn` per repetition: CUDA events around each call on the GPU, perf_counter on the CPU.

    `between` runs before each repetition outside the timed region (the L2 flush).
    """
    import torch

    if reps < 1:
        raise BenchError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if between is not None:
                between()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        samples = []
        for _ in range(reps):
            if between is not None:
                between()
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return summarize(samples)


def measure_copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 20) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written per second) of one large `copy_`."""
    import torch

    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), reps=reps, warmup=3, device=device)
    moved = 2 * n * 2
    return {"bytes": moved, "tbps": moved / (timing["median_ms"] * 1e-3) / 1e12, "timing": timing}


# --------------------------------------------------------------------------------------------------------------
# Bytes


def floor_bytes(cfg: ModelConfig, ctx: int) -> dict[str, int]:
    """The bytes one decode step at sequence length `ctx` must move through device memory, at the least.

    Weights once (bf16; a tied head counted once; an untied embedding table contributes only the token's row), the
    KV history read (ctx - 1 positions, K and V, every layer), the new K/V written, the fp32 logits written.
    """
    weights = cfg.weight_bytes(W_BYTES)
    if not cfg.tie_word_embeddings:
        weights -= (cfg.vocab_size - 1) * cfg.hidden_size * W_BYTES
    per_pos = 2 * cfg.num_hidden_layers * cfg.kv_size * W_BYTES
    out = {"weights": weights, "kv_read": (ctx - 1) * per_pos, "kv_write": per_pos,
           "activations": cfg.vocab_size * ACT_BYTES}
    out["total"] = sum(out.values())
    return out


def schedule_bytes(schedule: Any, ctx: int) -> int:
    """Bytes the schedule's instructions move at sequence length ctx, by the catalogue's cost (its own accounting)."""
    from megasynth.ir.program import resolve

    prog = resolve(schedule)
    geo = prog.geometry
    if geo is None:
        return 0
    total = 0
    for i in range(prog.n):
        op = prog.op[i]
        if op in OPS:
            layer = prog.layer[i]
            total += OPS[op].cost(geo, layer if layer is not None else -1, prog.args[i], ctx)[0]
    return total


# --------------------------------------------------------------------------------------------------------------
# Environment


def versions() -> dict[str, str | None]:
    """Versions of what the numbers depend on (read from package metadata: importing triton is not needed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers", "megasynth"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover - torch is a dependency
        out["cuda"] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out["git"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def device_info(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()})", "kind": "cpu",
                "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "kind": "cuda", "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}"}


# --------------------------------------------------------------------------------------------------------------
# State shared by the variants of one run


@dataclass
class State:
    spec: ModelSpec
    device: str
    weights: dict[str, Any]
    k: Any  # reference KV caches [L, nKV, S, hd], bf16
    v: Any
    token: int
    ctx: int = 0
    schedule: Any = None
    megakernel: Any = None  # built once, reused across ctx values
    hf: Any = None  # transformers model, built once

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.config

    @property
    def pos(self) -> int:
        return self.ctx - 1


def kv_history(cfg: ModelConfig, max_seq_len: int, ctx: int, seed: int) -> tuple[Any, Any]:
    """Random K/V for positions [0, ctx - 1) (fp32, CPU, seeded): the history every variant attends over."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * ctx)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max(ctx - 1, 0), cfg.hd)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def prefill(k_cache: Any, v_cache: Any, hist: tuple[Any, Any]) -> None:
    """Write the history into caches [L, nKV, S, hd] and zero the rest (so a stale step cannot leak in)."""
    n = hist[0].shape[2]
    for cache, h in zip((k_cache, v_cache), hist, strict=True):
        cache.zero_()
        cache[:, :, :n].copy_(h.to(device=cache.device, dtype=cache.dtype))


@contextlib.contextmanager
def static_rope(cfg: ModelConfig, pos: int, device: str) -> Iterator[None]:
    """Serve `kernels.reference.rope_cos_sin` from device tensors made once, so the step can be captured in a CUDA
    graph (its host-to-device copy from pageable memory cannot be) and compiled without CPU tensors in the graph."""
    from megasynth.kernels import reference

    orig = reference.rope_cos_sin
    cos, sin = orig(cfg, pos, device)

    def cached(c: ModelConfig, p: int, d: Any = "cpu") -> tuple[Any, Any]:
        return cos, sin

    reference.rope_cos_sin = cached  # type: ignore[assignment]
    try:
        yield
    finally:
        reference.rope_cos_sin = orig  # type: ignore[assignment]


def capture_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Capture `fn` in a CUDA graph (after warm-up on a side stream, as PyTorch asks); returns a replay function
    that gives the graph's static output."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    replay.graph = graph  # type: ignore[attr-defined]  # keep it alive with the function
    return replay


def bf16_decode_step(cfg: ModelConfig, weights: dict[str, Any], k_cache: Any, v_cache: Any, token: int, pos: int,
                     cos: Any, sin: Any) -> Any:
    """The decode step as a bf16 serving engine runs it: matvecs in the weights' dtype (fp32 accumulate inside
    cuBLAS), norms and softmax in fp32. A baseline only: the oracle stays megasynth.kernels.reference."""
    import torch
    import torch.nn.functional as F

    from megasynth.kernels.reference import apply_rope

    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd, cfg.rms_norm_eps
    dt = weights["embed"].dtype

    def norm(x: Any, w: Any) -> Any:
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean() + eps) * w.float()).to(dt)

    x = weights["embed"][token].float()
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        q, k, v = (weights[p + "wqkv"] @ norm(x, weights[p + "attn_norm"])).float().split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size])
        q = apply_rope(q.view(nh, hd), cos, sin)
        k_cache[layer, :, pos] = apply_rope(k.view(nkv, hd), cos, sin).to(k_cache.dtype)
        v_cache[layer, :, pos] = v.view(nkv, hd).to(v_cache.dtype)
        keys, values = k_cache[layer, :, :pos + 1][None], v_cache[layer, :, :pos + 1][None]
        o = F.scaled_dot_product_attention(q.to(k_cache.dtype).view(1, nh, 1, hd), keys, values,
                                           enable_gqa=True).reshape(-1).to(dt)
        x = x + (weights[p + "wo"] @ o).float()
        h = norm(x, weights[p + "mlp_norm"])
        act = F.silu((weights[p + "w_gate"] @ h).float()) * (weights[p + "w_up"] @ h).float()
        x = x + (weights[p + "w_down"] @ act.to(dt)).float()
    return (weights["lm_head"] @ norm(x, weights["final_norm"])).float()


# --------------------------------------------------------------------------------------------------------------
# Variants: each returns a zero-argument step that produces logits, plus notes for the JSON


def _v_torch_eager(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    from megasynth.kernels import reference

    return (lambda: reference.decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos)), {}


def _v_torch_graph(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    from megasynth.kernels import reference

    with static_rope(st.cfg, st.pos, st.device):
        replay = capture_graph(lambda: reference.decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos))
    return replay, {"note": "RoPE cos/sin for the position made once outside the graph"}


def _v_torch_bf16(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    from megasynth.kernels.reference import rope_cos_sin

    cos, sin = rope_cos_sin(st.cfg, st.pos, st.device)
    replay = capture_graph(lambda: bf16_decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos, cos, sin))
    return replay, {"note": "matvecs in bf16 (cuBLAS, fp32 accumulate), SDPA attention"}


def hf_model(cfg: ModelConfig, weights: dict[str, Any], device: str, dtype: Any) -> Any:
    """transformers' LlamaForCausalLM with our config and weights (raises Skip when transformers is missing)."""
    try:
        import transformers
    except ImportError:
        raise Skip("transformers is not installed") from None
    import torch

    from megasynth.kernels.weights import to_hf_state_dict

    scaling = cfg.rope_scaling_dict()
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if not scaling else {
        **scaling, "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.hd, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope, rope_theta=cfg.rope_theta,
        rope_scaling=scaling, max_position_embeddings=131072)
    with torch.device(device):  # initialise on the device: a 1B model's random init on the CPU takes long
        model = transformers.LlamaForCausalLM(hf_cfg).to(dtype=dtype)
    state = to_hf_state_dict(weights, cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    del state
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise BenchError(f"HF state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(device).eval()


def _v_hf_eager(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    import inspect

    import torch

    model = _hf_cached(st)
    from transformers import DynamicCache

    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    hist = [(st.k[layer, :, :st.pos][None], st.v[layer, :, :st.pos][None]) for layer in range(st.cfg.num_hidden_layers)]
    ids = torch.tensor([[st.token]], device=st.device)
    position = torch.tensor([[st.pos]], device=st.device)

    def step() -> Any:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(hist):
            cache.update(k, v, layer)
        with torch.inference_mode():
            out = model(input_ids=ids, position_ids=position, use_cache=True, **{kwarg: cache})
        return out.logits[0, -1].float()

    return step, {"note": f"attn_implementation={model.config._attn_implementation}; "
                          "fresh DynamicCache per step holding the ctx - 1 history (its fill is timed too)"}


def _hf_cached(st: State) -> Any:
    if st.hf is None:
        st.hf = hf_model(st.cfg, st.weights, st.device, st.weights["embed"].dtype)
    return st.hf


def _megakernel_api() -> Any:
    try:
        import megasynth.kernels.gpu as gpu

        gpu.Megakernel  # noqa: B018 - the lazy import of the interpreter (and triton) happens here
    except (ImportError, AttributeError) as exc:
        raise Skip(f"the GPU interpreter is not available ({exc})") from None
    return gpu


def _megakernel(st: State) -> Any:
    if st.megakernel is None:
        gpu = _megakernel_api()
        st.megakernel = gpu.Megakernel(st.schedule, st.weights, max_seq_len=st.spec.max_seq_len)
    return st.megakernel


def _mk_prefill(st: State, mk: Any) -> None:
    n = st.pos
    mk.k_cache.zero_()
    mk.v_cache.zero_()
    mk.k_cache[:, :, :n].copy_(st.k[:, :, :n])
    mk.v_cache[:, :, :n].copy_(st.v[:, :, :n])
    mk.set_position(st.token, st.pos)


def _v_megakernel(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Timed: one CUDA-graph replay of counter reset + the persistent kernel (embedding .. logits), token and position
    already on the device (as `kernels.gpu.timing.time_schedule` times it). `Megakernel.step` adds the position upload,
    a copy of the logits and the watchdog check (a host sync); it is timed too, as `step_call`."""
    mk = _megakernel(st)
    _mk_prefill(st, mk)
    graph = mk.graph()

    def replay() -> Any:
        graph.replay()
        return mk.logits

    def after(rec: dict[str, Any], opts: BenchOptions) -> None:
        mk.check()
        rec["step_call"] = time_fn(lambda: mk.step(st.token, st.pos), reps=opts.reps, warmup=2, device=st.device)
        rec["kernel"] = {"workers": mk.packed.workers, "instructions": mk.packed.n,
                         "occupancy": {str(k): v for k, v in mk.occupancy.items()}}

    return replay, {"launch": "CUDA graph replay: counter reset + persistent kernel (token/pos set on the device "
                              "before; Megakernel.step with its host sync is `step_call`)", "_after": after}


def stage_schedules(schedule: Any, workers: int | None = None) -> list[Any]:
    """Split a schedule into its stages for the no-megakernel ablation: maximal runs of consecutive ids with the same
    (op, layer), each a schedule of its own with no waits, signals or counters (the launch order orders them), its
    instructions dealt round-robin over the workers. Running them one after another in order is the schedule's
    meaning (ascending ids); instructions of one op in one layer never conflict except by commuting reduces."""
    from megasynth.ir.schedule import parse_schedule

    doc = schedule.to_json()
    ins = sorted(doc["instructions"], key=lambda i: i["id"])
    workers = workers or doc["target"]["workers"]
    runs: list[list[dict[str, Any]]] = []
    for i in ins:
        if runs and (runs[-1][-1]["op"], runs[-1][-1].get("layer")) == (i["op"], i.get("layer")):
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:
        w = min(workers, len(run))
        queues: list[list[int]] = [[] for _ in range(w)]
        body = []
        for n, i in enumerate(run):
            body.append({k: v for k, v in i.items() if k not in ("waits", "signals")})
            queues[n % w].append(i["id"])
        sub = {**doc, "instructions": body, "queues": queues, "counters": 0,
               "meta": {**doc.get("meta", {}), "stage": f"{run[0]['op']} L{run[0].get('layer')}"}}
        out.append(parse_schedule(sub))
    return out


def _v_per_op_graph(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    """One interpreter launch per stage, all captured in one CUDA graph. Each packed table has its own attention
    scratch (`opart`/`lse`); the stages share the whole schedule's so attn_reduce reads what attn_partial wrote."""
    mk = _megakernel(st)
    stages = stage_schedules(st.schedule, mk.packed.workers)
    packed = [mk.pack(s) for s in stages]
    for p in packed:
        p.device["opart"], p.device["lse"] = mk.packed.device["opart"], mk.packed.device["lse"]
    _mk_prefill(st, mk)

    def run() -> Any:
        for p in packed:
            mk.launch(p)
        return mk.logits

    replay = capture_graph(run)

    def after(rec: dict[str, Any], opts: BenchOptions) -> None:
        for p in packed:
            mk.check(p)

    return replay, {"stages": len(stages), "_after": after,
                    "note": f"{len(stages)} launches (grid = min(workers, stage size)), no counters between them"}


def _v_cpu_executor(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    try:
        from megasynth.kernels.cpu_executor import run_schedule
    except ImportError as exc:
        raise Skip(f"megasynth.kernels.cpu_executor is not available ({exc})") from None
    return (lambda: run_schedule(st.schedule, st.weights, st.k, st.v, st.token, st.pos, seed=0)), {}


RUNNERS: dict[str, Callable[[State], tuple[Callable[[], Any], dict[str, Any]]]] = {
    "torch_eager": _v_torch_eager, "torch_graph": _v_torch_graph, "torch_bf16": _v_torch_bf16,
    "hf_eager": _v_hf_eager, "per_op_graph": _v_per_op_graph, "megakernel": _v_megakernel,
    "cpu_executor": _v_cpu_executor,
}


def compare(logits: Any, ref: Any) -> dict[str, Any]:
    """Relative L2 error against the reference logits and whether the greedy token agrees."""
    a, b = logits.detach().float().reshape(-1).cpu(), ref.detach().float().reshape(-1).cpu()
    if a.shape != b.shape:
        return {"rel_l2": None, "argmax_match": False, "note": f"shape {tuple(a.shape)} != {tuple(b.shape)}"}
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    top2 = b.topk(2).values
    return {"rel_l2": rel, "argmax_match": bool(a.argmax() == b.argmax()),
            "ref_top2_margin": float(top2[0] - top2[1])}


def greedy_agreement(cfg: ModelConfig, weights: dict[str, Any], tokens: list[int], max_seq_len: int, device: str,
                     margin: float = 0.05) -> dict[str, Any]:
    """Teacher-force `tokens` (prompt first) through the reference: at each position, does its argmax equal the next
    token? Disagreements where the reference's top-2 margin exceeds `margin` are real errors, not near-ties."""
    import torch

    from megasynth.kernels.reference import decode_step, new_kv_cache

    k, v = new_kv_cache(cfg, max_seq_len, dtype=weights["embed"].dtype, device=device)
    agree, clear = 0, []
    with torch.inference_mode():
        for pos in range(len(tokens) - 1):
            top = decode_step(cfg, weights, k, v, tokens[pos], pos).topk(2)
            if int(top.indices[0]) == tokens[pos + 1]:
                agree += 1
            elif float(top.values[0] - top.values[1]) > margin:
                clear.append(pos)
    return {"steps": len(tokens) - 1, "agree": agree, "clear_mismatches": clear, "margin": margin}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0] if text else ''}"[:300]


def run_variant(name: str, st: State, opts: BenchOptions, ref: Any, between: Callable[[], None] | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Set up, check and time one variant; never raises for a variant-level failure (it is recorded)."""
    import torch

    label, launch = VARIANTS[name]
    rec: dict[str, Any] = {"label": label, "launch": launch}
    if opts.device != "cuda" and name in GPU_ONLY:
        return {**rec, "status": "skipped", "reason": "no CUDA (dry run)"}
    if opts.device == "cuda" and name == "cpu_executor":
        return {**rec, "status": "skipped", "reason": "CPU dry run only"}
    log(f"ctx {st.ctx}: {label}")
    try:
        t = time.perf_counter()
        step, notes = RUNNERS[name](st)
        after = notes.pop("_after", None)
        rec.update(notes)
        with torch.inference_mode():
            rec["check"] = compare(step(), ref)
            rec["setup_s"] = round(time.perf_counter() - t, 3)
            rec["timing"] = time_fn(step, reps=opts.reps, warmup=opts.warmup, device=opts.device, between=between)
            if after is not None:
                after(rec, opts)
        rec["status"] = "ok"
    except Skip as exc:
        rec.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' numbers
        rec.update(status="failed", reason=_short(exc))
        log(f"  {name} failed: {_short(exc)}")
    finally:
        if opts.device == "cuda":
            torch.cuda.synchronize()
    return rec


# --------------------------------------------------------------------------------------------------------------
# torch.compile in a child process (a hang or a long compile is bounded by killing it)


def compile_worker(opts: BenchOptions, emit: Callable[[dict[str, Any]], None]) -> None:
    """Child side: compile the reference step and time it at every ctx; emits one result dict per ctx."""
    import torch

    from megasynth.kernels import reference

    spec = get_model(opts.model)
    st = _new_state(spec, opts)
    for t in [st.k, st.v, *st.weights.values()]:
        if opts.device == "cuda":
            torch._dynamo.mark_static_address(t)
    for ctx in opts.ctxs:
        st.ctx = ctx
        prefill(st.k, st.v, kv_history(spec.config, spec.max_seq_len, ctx, opts.seed))
        label, launch = VARIANTS["torch_compile"]
        rec: dict[str, Any] = {"ctx": ctx, "label": label, "launch": launch}
        try:
            with torch.inference_mode():
                ref = reference.decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos)
            with static_rope(st.cfg, st.pos, opts.device):
                fn = torch.compile(lambda: reference.decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos),
                                   mode=opts.compile_mode, backend=opts.compile_backend)
                t = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(3):  # reduce-overhead records its graph on a later call than the first
                        out = fn()
                    if opts.device == "cuda":
                        torch.cuda.synchronize()
                    rec["compile_s"] = round(time.perf_counter() - t, 3)
                    rec["check"] = compare(out, ref)
                    rec["timing"] = time_fn(fn, reps=opts.reps, warmup=opts.warmup, device=opts.device)
            rec["status"] = "ok"
            rec["note"] = f"mode={opts.compile_mode}, backend={opts.compile_backend}, weights/KV marked static"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            rec.update(status="failed", reason=_short(exc))
        emit(rec)


def run_compile(opts: BenchOptions, log: Callable[[str], None]) -> dict[int, dict[str, Any]]:
    """Parent side: run `compile_worker` in a child process (own session) for at most compile_timeout_s seconds."""
    label, launch = VARIANTS["torch_compile"]
    base = {"label": label, "launch": launch}
    if opts.device != "cuda" and opts.compile_backend == "inductor" and opts.compile_mode == "reduce-overhead":
        return {c: {**base, "status": "skipped", "reason": "no CUDA (dry run)"} for c in opts.ctxs}
    log(f"torch.compile in a child process (limit {opts.compile_timeout_s:.0f} s)")
    payload = json.dumps(asdict(opts))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo: `synth` must import there too
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "megasynth.measure.bench", "--compile-worker", payload],
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
    skipped_graphs = [ln.strip() for ln in tail if "skipping cudagraphs" in ln]
    if skipped_graphs:  # inductor fell back to plain launches: the time is not a CUDA-graph time, say so
        for rec in results.values():
            rec["note"] = f"{rec.get('note', '')}; inductor: {skipped_graphs[0][:200]}".lstrip("; ")
    why = (f"compile + timing exceeded the {opts.compile_timeout_s:.0f} s limit (child killed)" if timed_out else
           f"child exited with code {proc.returncode}: {tail[-1][:200] if tail else 'no output'}")
    for c in opts.ctxs:
        results.setdefault(c, {**base, "status": "skipped", "reason": why})
    return results


# --------------------------------------------------------------------------------------------------------------
# The run


def _new_state(spec: ModelSpec, opts: BenchOptions) -> State:
    import torch

    from megasynth.kernels.reference import new_kv_cache
    from megasynth.kernels.weights import WeightsError, model_weights

    dtype = torch.bfloat16
    try:
        weights = model_weights(spec.config, opts.weights_dir, seed=opts.seed, dtype=dtype, device=opts.device)
    except WeightsError as exc:
        raise BenchError(str(exc)) from None
    k, v = new_kv_cache(spec.config, spec.max_seq_len, dtype=dtype, device=opts.device)
    if not 0 <= opts.token < spec.config.vocab_size:
        raise BenchError(f"--token {opts.token} is outside the vocabulary [0, {spec.config.vocab_size})")
    return State(spec, opts.device, weights, k, v, opts.token)


def load_bench_schedule(spec: ModelSpec, path: str | None, verify: bool) -> tuple[Any, dict[str, Any]]:
    """The schedule to run (default: the naive lowering for the SM count) and a summary for the JSON."""
    from megasynth.ir.errors import ScheduleError
    from megasynth.ir.schedule import load_schedule

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
    else:
        schedule = load_schedule(path)
        from pathlib import Path

        text = Path(path).read_text(encoding="utf-8")
        info = {"path": path, "source": "file"}
        if schedule.model is None:
            raise ScheduleError("the schedule has no `model`; only catalogue-op schedules can run", "$.model", path)
        from megasynth.ir.model import ModelConfig as MC

        if MC.from_hf(schedule.model.config) != spec.config:
            raise ScheduleError(f"the schedule's model config is not {spec.name}'s", "$.model.config", path)
        if schedule.model.max_seq_len != spec.max_seq_len:
            raise ScheduleError(f"max_seq_len {schedule.model.max_seq_len} differs from {spec.name}'s "
                                f"{spec.max_seq_len}", "$.model.max_seq_len", path)
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
            raise BenchError(f"{path or 'the schedule'}: rejected by the validator: {report.findings[0].message}")
    return schedule, info


def add_ratios(ctx_rec: dict[str, Any], copy_tbps: float) -> None:
    """Fill the ratio columns of one ctx's variants from their measured medians (nothing is estimated)."""
    floor = ctx_rec["floor"]
    floor["ms"] = floor["bytes"]["total"] / (copy_tbps * 1e12) * 1e3
    variants = ctx_rec["variants"]
    def median(name: str) -> float | None:
        rec = variants.get(name, {})
        return rec["timing"]["median_ms"] if rec.get("status") == "ok" else None

    base_ms, bf16_ms = median(BASELINE), median("torch_bf16")
    for rec in variants.values():
        if rec.get("status") != "ok":
            continue
        ms = rec["timing"]["median_ms"]
        rec["speedup_vs_graph"] = base_ms / ms if base_ms else None
        rec["speedup_vs_bf16_graph"] = bf16_ms / ms if bf16_ms else None
        rec["x_floor"] = ms / floor["ms"]
        rec["achieved_tbps"] = floor["bytes"]["total"] / (ms * 1e-3) / 1e12
        rec["pct_copy_bw"] = 100.0 * floor["ms"] / ms
    for name in ("per_op_graph", "megakernel"):  # bytes the schedule moves by the catalogue's own accounting
        rec = variants.get(name, {})
        if rec.get("status") == "ok" and ctx_rec.get("schedule_bytes"):
            rec["schedule_tbps"] = ctx_rec["schedule_bytes"] / (rec["timing"]["median_ms"] * 1e-3) / 1e12


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure every wanted variant at every ctx; returns the JSON-ready result."""
    import torch

    spec = get_model(opts.model)
    bad = [c for c in opts.ctxs if not 1 <= c <= spec.max_seq_len]
    if bad:
        raise BenchError(f"--ctx {bad[0]} must be in [1, {spec.max_seq_len}] for {spec.name}")
    unknown = [v for v in opts.variants or [] if v not in VARIANTS]
    if unknown:
        raise BenchError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    if not 0 <= opts.token < spec.config.vocab_size:
        raise BenchError(f"--token {opts.token} is outside the vocabulary [0, {spec.config.vocab_size})")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("CUDA is not available; use --dry-run to exercise the command on the CPU")
    t0 = time.perf_counter()
    schedule, sched_info = load_bench_schedule(spec, opts.schedule, opts.verify)
    dev = device_info(opts.device)
    log(f"{dev['name']}: copy bandwidth")
    copy = measure_copy_bandwidth(opts.device, opts.copy_bytes if opts.device == "cuda" else 1 << 26)
    log(f"copy bandwidth {copy['tbps']:.3f} TB/s; building weights")
    st = _new_state(spec, opts)
    st.schedule = schedule
    between = None
    if opts.flush_l2 and opts.device == "cuda":
        scratch = torch.empty(max(2 * (dev.get("l2_bytes") or 0), 1 << 27), dtype=torch.uint8, device="cuda")
        between = scratch.zero_
    result: dict[str, Any] = {
        "format": FORMAT, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["synth", *sys.argv[1:]]) if sys.argv else None,
        "model": spec.name, "config": spec.config.to_hf(), "max_seq_len": spec.max_seq_len,
        "device": dev, "versions": versions(), "dry_run": opts.device != "cuda",
        "settings": {"reps": opts.reps, "warmup": opts.warmup, "seed": opts.seed, "weights": opts.weights_dir,
                     "token": opts.token,
                     "dtype": "bfloat16 weights and KV cache", "flush_l2": opts.flush_l2,
                     "timer": "CUDA events per repetition" if opts.device == "cuda" else "perf_counter",
                     "position": "pos = ctx - 1 (attention over ctx positions), random KV history",
                     "compile_timeout_s": opts.compile_timeout_s,
                     "weights_over_l2": (floor_bytes(spec.config, 1)["weights"] / dev["l2_bytes"]
                                         if dev.get("l2_bytes") else None)},
        "schedule": sched_info, "copy_bandwidth": copy, "results": [],
    }
    for ctx in opts.ctxs:
        st.ctx = ctx
        hist = kv_history(spec.config, spec.max_seq_len, ctx, opts.seed)
        prefill(st.k, st.v, hist)
        with torch.inference_mode():
            from megasynth.kernels.reference import decode_step

            ref = decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos)
        rec: dict[str, Any] = {"ctx": ctx, "pos": st.pos,
                               "floor": {"bytes": floor_bytes(spec.config, ctx)},
                               "schedule_bytes": schedule_bytes(schedule, ctx), "variants": {}}
        for name in VARIANTS:
            if name == "torch_compile" or not opts.wanted(name):
                continue
            prefill(st.k, st.v, hist)
            rec["variants"][name] = run_variant(name, st, opts, ref, between, log)
        result["results"].append(rec)
    if opts.wanted("torch_compile"):
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


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


SHORT = {"torch_eager": "torch eager", "torch_graph": "torch graph", "torch_bf16": "torch bf16 graph",
         "hf_eager": "HF eager", "torch_compile": "torch.compile", "per_op_graph": "per-op graph",
         "megakernel": "megakernel", "cpu_executor": "CPU executor"}


def render(result: dict[str, Any]) -> list[Any]:
    """Rich tables, one per ctx: median, spread, ratios, achieved bandwidth, check against the reference; then one
    line per variant saying how it is launched, or why it was skipped."""
    from rich.table import Table

    out: list[Any] = []
    copy = result["copy_bandwidth"]["tbps"]
    for rec in result["results"]:
        floor = rec["floor"]
        title = (f"{result['model']}, ctx {rec['ctx']}, {result['device']['name']}"
                 f"{' (DRY RUN on the CPU)' if result['dry_run'] else ''}: floor {floor['ms']:.3f} ms = "
                 f"{floor['bytes']['total'] / 1e9:.3f} GB / {copy:.2f} TB/s copy")
        table = Table(title=title, title_justify="left")
        for col in ("variant", "median ms", "p10-p90", "min-max", "vs graph", "vs bf16", "x floor", "TB/s", "% copy",
                    "check"):
            table.add_column(col, justify="left" if col in ("variant", "check") else "right", no_wrap=True)
        notes = []
        for name, v in rec["variants"].items():
            short = SHORT.get(name, name)
            if v.get("status") != "ok":
                table.add_row(short, "-", "-", "-", "-", "-", "-", "-", "-", f"[yellow]{v['status']}[/yellow]")
                notes.append(f"  {short}: [yellow]{v['status']}: {v.get('reason', '')}[/yellow]")
                continue
            t, chk = v["timing"], v.get("check", {})
            rel = chk.get("rel_l2")
            good = rel is not None and rel <= 2e-2
            check = f"err {_fmt(rel, '.1e')}" + ("" if chk.get("argmax_match") else " argmax differs")
            table.add_row(short, f"{t['median_ms']:.3f}", f"{t['p10_ms']:.3f}-{t['p90_ms']:.3f}",
                          f"{t['min_ms']:.3f}-{t['max_ms']:.3f}", _fmt(v.get("speedup_vs_graph"), ".2f", "x"),
                          _fmt(v.get("speedup_vs_bf16_graph"), ".2f", "x"),
                          f"{v['x_floor']:.2f}", f"{v['achieved_tbps']:.2f}", f"{v['pct_copy_bw']:.0f}%",
                          f"[green]{check}[/green]" if good else f"[red]{check}[/red]")
            extra = f"; {v['note']}" if v.get("note") else ""
            if v.get("schedule_tbps"):
                extra += (f"; the schedule's own bytes (catalogue cost) {rec['schedule_bytes'] / 1e9:.3f} GB at "
                          f"{v['schedule_tbps']:.2f} TB/s")
            if v.get("step_call"):
                extra += f"; Megakernel.step() with its host sync: {v['step_call']['median_ms']:.3f} ms median"
            notes.append(f"  {short}: {v['launch']}{extra}")
        out.append(table)
        out.append("\n".join(notes))
    out.append("vs graph = CUDA-graph PyTorch reference time / this time (the reference upcasts weights to fp32); "
               "vs bf16 = the same against the bf16-native PyTorch step in a CUDA graph; x floor = this time / floor; "
               "TB/s = floor bytes / this time; check = relative L2 error of the logits against the eager reference")
    return out


def _worker_main(argv: list[str]) -> int:
    """`python -m megasynth.measure.bench --compile-worker JSON`: the child process of `run_compile`."""
    if len(argv) != 2 or argv[0] != "--compile-worker":
        print("usage: python -m megasynth.measure.bench --compile-worker OPTIONS_JSON", file=sys.stderr)
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
    sys.exit(_worker_main(sys.argv[1:]))
