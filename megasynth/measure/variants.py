"""The variants `synth bench` times: each decodes the same token at the same position over the same random KV
history and weights, and its logits are checked against the fp32 reference before its time is reported.

  torch_eager    kernels.reference.decode_step on the device (it upcasts every weight matrix to fp32 each step)
  torch_graph    the same reference step captured in one CUDA graph
  hf_eager       transformers' LlamaForCausalLM, bf16, same weights, DynamicCache pre-filled to ctx
  torch_bf16     the plain bf16 PyTorch step (torch_step.bf16_decode_step: fused QKV and gate/up, F.rms_norm, SDPA
                 with GQA) in one CUDA graph; on the CPU (dry run) called directly
  torch_compile  torch.compile (max-autotune, no inductor graphs) of that bf16 step, captured in one CUDA graph, in a
                 child process with a time limit (megasynth.measure.compile)
  per_op_graph   the no-megakernel ablation: one launch of the persistent interpreter per stage (all instructions of
                 one op in one layer, no counters), the launches captured in one CUDA graph
  megakernel     the persistent interpreter running the whole schedule (default: the naive lowering)
  cpu_executor   dry run without CUDA only: the schedule on kernels.cpu_executor (tests the command's plumbing)

The PyTorch variants compete for "best PyTorch", the line the megakernel's ratios are against.

At a batch of B sequences (all at the same ctx, each with its own KV history and token), the reference is
`decode_batch` (each sequence alone); torch_eager and torch_graph run it, torch_bf16 and torch_compile compute the B
sequences in one step (`bf16_decode_batch`), cpu_executor runs the batched schedule, the megakernel runs it on
interpreter v10 (v9 where that is the batch's default: `pack.default_batch_interpreter`). The variants in
`BATCH_ONE` are reported as skipped, with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from megasynth.ir.model import DoesNotFit, ModelConfig, check_fits, kv_cache_part
from megasynth.lowering.models import ModelSpec
from megasynth.measure.options import BenchError, BenchOptions, Skip
from megasynth.measure.timing import capture_graph, time_fn
from megasynth.measure.torch_step import (
    StepWeights,
    batch_tokens,
    bf16_decode_batch,
    bf16_decode_step,
    bf16_rope,
    compare,
    hf_model,
    kv_history,
    static_rope,
    step_weights,
)

#: name -> (label, how it is launched); the order is the table's order.
VARIANTS: dict[str, tuple[str, str]] = {
    "torch_eager": ("PyTorch fp32-upcasting reference, eager", "eager: one launch per torch op"),
    "torch_graph": ("PyTorch fp32-upcasting reference + CUDA graph", "CUDA graph replay"),
    "hf_eager": ("HF transformers eager", "eager: one launch per torch op"),
    "torch_bf16": ("PyTorch bf16 + CUDA graph", "CUDA graph replay of the bf16 step (fused QKV and gate/up, SDPA)"),
    "torch_compile": ("torch.compile of the bf16 step + CUDA graph",
                      "inductor kernels of the bf16 step, CUDA graph replay"),
    "per_op_graph": ("per-op Triton launches + CUDA graph", "one interpreter launch per stage, CUDA graph replay"),
    "megakernel": ("megakernel (schedule)", "CUDA graph replay: counter reset + persistent kernel"),
    "cpu_executor": ("schedule on CPU executor (dry run)", "Python interpreter of the schedule"),
}
#: the variants that compete for the best PyTorch step
PYTORCH = ("torch_eager", "torch_graph", "hf_eager", "torch_bf16", "torch_compile")
GPU_ONLY = {"torch_graph", "torch_compile", "per_op_graph", "megakernel"}
#: the default set on a GPU: the best PyTorch candidates, the ablation and the megakernel (the fp32-upcasting
#: reference and HF eager are 3-15x slower than the bf16 step and add minutes on llama-8b)
DEFAULT_GPU = ("torch_bf16", "torch_compile", "per_op_graph", "megakernel")
DEFAULT_CPU = ("torch_eager", "torch_bf16", "torch_compile", "megakernel", "cpu_executor")
#: variants that decode one sequence per step only -> why (reported as `skipped` at a batch > 1)
BATCH_ONE = {
    "hf_eager": "batch 1 only: the HF baseline decodes one sequence (its pre-filled DynamicCache holds one history)",
    "per_op_graph": "batch 1 only: the per-op ablation launches the batch-1 interpreter build",
}


def default_variants(device: str) -> list[str]:
    """The variants measured when none are named."""
    return list(DEFAULT_GPU if device == "cuda" else DEFAULT_CPU)


@dataclass
class State:
    """What the variants of one run share: weights, caches, the schedule and what is built once across ctx values."""

    spec: ModelSpec
    device: str
    weights: dict[str, Any]
    k: Any  # reference KV caches [L, nKV, S, hd], bf16; [L, B, nKV, S, hd] (a slot per sequence) for a batch > 1
    v: Any
    token: int
    ctx: int = 0
    schedule: Any = None  # the schedule this ctx runs (a set's member for it)
    schedules: Any = None  # what was loaded: that schedule, or the schedule set (the megakernel picks by position)
    megakernel: Any = None
    hf: Any = None
    step_weights: StepWeights | None = None
    token_ids: Any = None  # the batch's tokens as a device tensor [B], made once (a CUDA graph reads it in place)
    kernel_options: list[str] = field(default_factory=list)  # the megakernel's interpreter settings, KEY=VALUE

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.config

    @property
    def pos(self) -> int:
        return self.ctx - 1

    @property
    def batch(self) -> int:
        return self.spec.batch

    @property
    def tokens(self) -> list[int]:
        """Each sequence's token (the batch-1 token first)."""
        return batch_tokens(self.token, self.batch, self.cfg.vocab_size)

    def history(self, seed: int) -> tuple[Any, Any]:
        """The random KV history at this ctx, one per sequence for a batch (`kv_history`)."""
        return kv_history(self.cfg, self.spec.max_seq_len, self.ctx, seed, self.batch if self.batch > 1 else None)


def new_state(spec: ModelSpec, opts: BenchOptions) -> State:
    """bf16 weights (random from the seed, or the checkpoint) and zeroed bf16 KV caches on the device."""
    import torch

    from megasynth.kernels.reference import new_kv_cache
    from megasynth.kernels.weights import WeightsError, model_weights

    if not 0 <= opts.token < spec.config.vocab_size:
        raise BenchError(f"--token {opts.token} is outside the vocabulary [0, {spec.config.vocab_size})")
    dtype = torch.bfloat16
    if opts.device == "cuda":  # this state's weights and KV cache; the megakernel variant checks its own copy
        desc, kv = kv_cache_part(spec.config, spec.max_seq_len)
        kv_part = (desc, kv) if spec.batch == 1 else (f"{spec.batch} x {desc}", spec.batch * kv)
        parts = [kv_part, ("weights", spec.config.weight_bytes(2))]
        try:
            check_fits(parts, torch.cuda.mem_get_info()[0])
        except DoesNotFit as exc:
            raise BenchError(str(exc)) from None
    try:
        weights = model_weights(spec.config, opts.weights_dir, seed=opts.seed, dtype=dtype, device=opts.device)
    except WeightsError as exc:
        raise BenchError(str(exc)) from None
    k, v = new_kv_cache(spec.config, spec.max_seq_len, dtype=dtype, device=opts.device,
                        batch=spec.batch if spec.batch > 1 else None)
    return State(spec, opts.device, weights, k, v, opts.token, kernel_options=list(opts.kernel_options))


def reference_step(st: State) -> Callable[[], Any]:
    """The fp32 reference at the state's position as a zero-argument function: `decode_step` (logits [V]), or for a
    batch `decode_batch` (each sequence alone, logits [B, V])."""
    from megasynth.kernels import reference

    if st.batch == 1:
        return lambda: reference.decode_step(st.cfg, st.weights, st.k, st.v, st.token, st.pos)
    tokens, positions = st.tokens, [st.pos] * st.batch
    return lambda: reference.decode_batch(st.cfg, st.weights, st.k, st.v, tokens, positions)


def batch_token_ids(st: State) -> Any:
    """The batch's tokens as an int64 device tensor [B] at a fixed address (made once per run)."""
    import torch

    if st.token_ids is None:
        st.token_ids = torch.tensor(st.tokens, dtype=torch.int64, device=st.device)
    return st.token_ids


def bf16_step_fn(st: State) -> Callable[[], Any]:
    """The bf16 step at the state's position as a zero-argument function (weights laid out once per run); a batch
    > 1 decodes all its sequences in one step (`bf16_decode_batch`)."""
    if st.step_weights is None:
        st.step_weights = step_weights(st.cfg, st.weights)
    w, cfg, k, v, token, pos = st.step_weights, st.cfg, st.k, st.v, st.token, st.pos
    cos, sin = bf16_rope(cfg, pos, st.device)
    if st.batch > 1:
        ids = batch_token_ids(st)
        return lambda: bf16_decode_batch(cfg, w, k, v, ids, pos, cos, sin)
    return lambda: bf16_decode_step(cfg, w, k, v, token, pos, cos, sin)


# Runners: each returns a zero-argument step that produces logits, plus notes for the JSON ("_after": a function
# run after the timing with (record, options)).


_ONE_BY_ONE = "the batch's sequences one after another (reference.decode_batch)"


def _v_torch_eager(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    return reference_step(st), ({"note": _ONE_BY_ONE} if st.batch > 1 else {})


def _v_torch_graph(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    with static_rope(st.cfg, st.pos, st.device):  # every sequence of a batch is at the same position
        replay = capture_graph(reference_step(st))
    return replay, {"note": "RoPE cos/sin for the position made once outside the graph"
                            + (f"; {_ONE_BY_ONE}" if st.batch > 1 else "")}


def _v_torch_bf16(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    fn = bf16_step_fn(st)
    batched = f"; the {st.batch} sequences in one step ([B, H] matmuls, batched SDPA)" if st.batch > 1 else ""
    if st.device != "cuda":
        return fn, {"launch": "eager (no CUDA graph on the CPU)", **({"note": batched[2:]} if batched else {})}
    return capture_graph(fn), {"note": "bf16 weights, activations and KV cache; RoPE cos/sin made once" + batched}


def _v_hf_eager(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    import inspect

    import torch

    if st.hf is None:
        st.hf = hf_model(st.cfg, st.weights, st.device, st.weights["embed"].dtype)
    model = st.hf
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
        try:
            config = gpu.kernel_config(st.kernel_options, batch=st.batch, device=st.device, cfg=st.spec.config) \
                if st.kernel_options else None  # Megakernel's own choice
            st.megakernel = gpu.Megakernel(st.schedules or st.schedule, st.weights,
                                           max_seq_len=st.spec.max_seq_len, config=config)
        except DoesNotFit as exc:  # beside this state's own weights and KV cache
            raise Skip(str(exc)) from None
    return st.megakernel


def _mk_prefill(st: State, mk: Any) -> None:
    """The megakernel's KV cache holds the state's history (positions before pos; every sequence's slot at a batch)
    and its runtime inputs the state's token(s) and position(s)."""
    n = st.pos
    mk.k_cache.zero_()
    mk.v_cache.zero_()
    mk.k_cache[..., :n, :].copy_(st.k[..., :n, :])  # [L, (B,) nKV, S, hd]: positions are the second-last axis
    mk.v_cache[..., :n, :].copy_(st.v[..., :n, :])
    mk.set_position(*_mk_inputs(st))


def _mk_inputs(st: State) -> tuple[Any, Any]:
    """Megakernel.step's token and position: scalars at batch 1, one per sequence at a batch."""
    return (st.token, st.pos) if st.batch == 1 else (st.tokens, [st.pos] * st.batch)


def _v_megakernel(st: State) -> tuple[Callable[[], Any], dict[str, Any]]:
    """Timed: one CUDA-graph replay of counter reset + the persistent kernel (embedding .. logits), token and position
    already on the device (as `kernels.gpu.timing.time_schedule` times it). `Megakernel.step` adds the position upload,
    a copy of the logits and the watchdog check (a host sync); it is timed too, as `step_call`."""
    mk = _megakernel(st)
    _mk_prefill(st, mk)
    graph = mk.graph()

    logits = mk.logits.view(st.batch, -1) if st.batch > 1 else mk.logits

    def replay() -> Any:
        graph.replay()
        return logits

    def after(rec: dict[str, Any], opts: BenchOptions) -> None:
        mk.check()
        rec["step_call"] = time_fn(lambda: mk.step(*_mk_inputs(st)), reps=opts.reps, warmup=2, device=st.device)
        rec["kernel"] = {"workers": mk.packed.workers, "instructions": mk.packed.n,
                         "occupancy": {str(k): v for k, v in mk.occupancy.items()},
                         "settings": asdict(mk.kcfg)}  # the interpreter's, defaults included

    how = f" on interpreter {'v10' if mk.v10 else 'v9'}" if st.batch > 1 else ""
    if st.kernel_options:
        how += f"; interpreter settings {', '.join(st.kernel_options)}"
    return replay, {"launch": "CUDA graph replay: counter reset + persistent kernel (token/pos set on the device "
                              f"before; Megakernel.step with its host sync is `step_call`){how}", "_after": after}


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
    if st.batch > 1:  # the batched schedule, every sequence at the same position
        tokens, positions = st.tokens, [st.pos] * st.batch
        return (lambda: run_schedule(st.schedule, st.weights, st.k, st.v, tokens, positions, seed=0)), {}
    return (lambda: run_schedule(st.schedule, st.weights, st.k, st.v, st.token, st.pos, seed=0)), {}


RUNNERS: dict[str, Callable[[State], tuple[Callable[[], Any], dict[str, Any]]]] = {
    "torch_eager": _v_torch_eager, "torch_graph": _v_torch_graph, "torch_bf16": _v_torch_bf16,
    "hf_eager": _v_hf_eager, "per_op_graph": _v_per_op_graph, "megakernel": _v_megakernel,
    "cpu_executor": _v_cpu_executor,
}


def short_error(exc: BaseException) -> str:
    """One line naming the exception (for a variant's `reason`)."""
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0] if text else ''}"[:300]


def run_variant(name: str, st: State, opts: BenchOptions, ref: Any, between: Callable[[], None] | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Set up, check and time one variant; never raises for a variant-level failure (it is recorded)."""
    import torch

    label, launch = VARIANTS[name]
    rec: dict[str, Any] = {"label": label, "launch": launch}
    if st.batch > 1 and name in BATCH_ONE:
        return {**rec, "status": "skipped", "reason": BATCH_ONE[name]}
    if opts.device != "cuda" and name in GPU_ONLY:
        return {**rec, "status": "skipped", "reason": "no CUDA (dry run)"}
    if opts.device == "cuda" and name == "cpu_executor":
        return {**rec, "status": "skipped", "reason": "CPU dry run only"}
    from megasynth.kernels.gpu.timing import GpuHangError, wait_for_gpu

    log(f"ctx {st.ctx}: {label}")
    hung = False
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
    except GpuHangError:  # nothing more can run on this GPU in this process: stop the bench with the message
        hung = True
        raise
    except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' numbers
        rec.update(status="failed", reason=short_error(exc))
        log(f"  {name} failed: {short_error(exc)}")
    finally:
        if opts.device == "cuda" and not hung:
            wait_for_gpu(f"the {name} variant's work")
    return rec
