"""The host runtime of the persistent megakernel, shared by both interpreters: `Megakernel` stacks the weights, owns
the KV cache and workspace, packs schedules into device tables, checks that the grid can be resident, launches
interpreter v10 (kernels/gpu/stream.py, `StreamConfig`) or v9 (kernels/gpu/v9.py, `KernelConfig`), captures a step
as a CUDA graph, turns the kernel's error buffer into `WatchdogError` and exports traces.

`Megakernel.step(token, pos)` replays a CUDA graph holding the whole step: counter reset + the kernel (embedding,
all layers, the LM head). Given a schedule set (one schedule per context range), it packs every member once and each
step replays the graph of the member whose range holds `pos`: only the tables change, never the kernel or the
buffers. Static queues deadlock unless every program is resident at once, so the grid is checked
against the SM count and the compiled kernel's occupancy before the first launch. Before allocating anything, the KV
cache (sized by max_seq_len), the stacked weights and the workspace are checked against the free GPU memory
(`megasynth.ir.model.check_fits`).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megasynth.ir.catalogue import rope_inv_freq
from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ModelConfig, check_fits, gpu_memory_parts
from megasynth.ir.schedule import Schedule
from megasynth.ir.schedule_set import ScheduleSet
from megasynth.kernels.gpu.pack import (
    TRACE_FIELDS,
    Packed,
    check_k_ranges,
    check_mma_k_starts,
    check_runs_batched_on_v10,
    check_runs_on_v9,
    default_batch_interpreter,
    pack,
)
from megasynth.kernels.gpu.timing import WatchdogError, wait_for_gpu
from megasynth.kernels.gpu.v9 import KernelConfig, kernel_constexprs, staging_elements, v9_megakernel

ERR_FIELDS = 8  # flag, worker, instruction id, counter, current, needed, smid, 0


def default_config(device: torch.device, cfg: ModelConfig | None = None, batch: int = 1) -> Any:
    """Interpreter v10 (`megasynth.kernels.gpu.stream.StreamConfig`: TMA, warp specialization; `stream_config(cfg)`,
    the defaults for the model's shape) on Hopper and newer GPUs (for a batch: where `pack.default_batch_interpreter`
    names it for the model `cfg` and `stream.batch_limits` allows it); interpreter v9 (`KernelConfig`) elsewhere,
    Triton's CPU interpreter included (it cannot run Gluon)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        from megasynth.kernels.gpu.stream import batch_limits, stream_config

        if batch == 1 or (cfg is not None and default_batch_interpreter(cfg, batch) == "v10"
                          and batch_limits(cfg, stream_config(cfg), batch) is None):
            return stream_config(cfg)
    return KernelConfig()


def config_with(base: Any, items: Sequence[str]) -> Any:
    """`base` (a `StreamConfig` or `KernelConfig`) with KEY=VALUE items applied, each value read as its field's type
    (true/false for a switch). ValueError naming the item for an unknown key or a value of the wrong type."""
    fields = {f.name: f for f in dataclasses.fields(base)}
    changes: dict[str, Any] = {}
    for item in items:
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        if key not in fields:
            raise ValueError(f"{item!r}: {type(base).__name__} has no field {key!r} (it has: {', '.join(fields)})")
        kind = type(getattr(base, key))
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError(text)
                value: Any = text.lower() in ("true", "1", "yes", "on")
            elif kind is str:  # a name (x_dtype=fp32), quoted or not
                value = text.strip("'\"")
            else:
                value = ast.literal_eval(text)
                if type(value) is not kind:
                    raise ValueError(text)
        except (ValueError, SyntaxError, TypeError):
            raise ValueError(f"{item!r}: {key} takes {kind.__name__} values, not {text!r}") from None
        changes[key] = value
    return dataclasses.replace(base, **changes)


def kernel_config(items: Sequence[str], *, batch: int = 1, device: str | torch.device = "cuda",
                  cfg: ModelConfig | None = None) -> Any:
    """The interpreter config that `Megakernel` would pick for this model, batch and device (`default_config`), or
    the one `interpreter=v9|v10` names, with the other KEY=VALUE items applied (`config_with`)."""
    rest: list[str] = []
    named: list[str] = []
    for item in items:
        key, _, value = item.partition("=")
        if key.strip() == "interpreter":
            named.append(value.strip())
        else:
            rest.append(item)
    if len(named) > 1:
        raise ValueError("interpreter is given more than once")
    if named and named[0] not in ("v9", "v10"):
        raise ValueError(f"interpreter={named[0]}: expected v9 or v10")
    if named == ["v10"] and batch > 1 and cfg is not None:
        from megasynth.kernels.gpu.stream import StreamConfig, batch_limits

        why = batch_limits(cfg, StreamConfig(), batch)
        if why:
            raise ValueError(f"interpreter=v10 cannot run a batch of {batch} of this model: {why}; v9 can")
    if named == ["v9"]:
        base: Any = KernelConfig()
    elif named == ["v10"]:
        from megasynth.kernels.gpu.stream import stream_config

        base = stream_config(cfg)
    else:
        base = default_config(torch.device(device), cfg, batch)
    return config_with(base, rest)


def stack_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Catalogue weights -> per-kind stacks across layers (one base pointer + layer offset): matrices bf16, norms
    fp32; a tied LM head shares the embedding's storage. With `qkv_bias`, `bqkv` [L, qkv] fp32; with `qk_norm`,
    `qk_norm` [L, 2 hd] fp32 (each layer's q_norm then k_norm)."""
    n = cfg.num_hidden_layers

    def mat(name: str) -> torch.Tensor:
        return torch.stack([weights[f"layers.{i}.{name}"].to(device=device, dtype=torch.bfloat16)
                            for i in range(n)]).contiguous()

    def vec(name: str) -> torch.Tensor:
        return torch.stack([weights[f"layers.{i}.{name}"].to(device=device, dtype=torch.float32)
                            for i in range(n)]).contiguous()

    out = {"wqkv": mat("wqkv"), "wo": mat("wo"), "w_gate": mat("w_gate"), "w_up": mat("w_up"),
           "w_down": mat("w_down"), "attn_norm": vec("attn_norm"), "mlp_norm": vec("mlp_norm"),
           "embed": weights["embed"].to(device=device, dtype=torch.bfloat16).contiguous(),
           "final_norm": weights["final_norm"].to(device=device, dtype=torch.float32).contiguous()}
    tied = weights["lm_head"] is weights["embed"] or (
        weights["lm_head"].shape == weights["embed"].shape
        and weights["lm_head"].data_ptr() == weights["embed"].data_ptr())
    if cfg.qkv_bias:
        out["bqkv"] = vec("bqkv")
    if cfg.qk_norm:
        out["qk_norm"] = torch.cat([vec("q_norm"), vec("k_norm")], dim=1).contiguous()
    out["lm_head"] = out["embed"] if tied else weights["lm_head"].to(device=device, dtype=torch.bfloat16).contiguous()
    shapes = {"wqkv": (n, cfg.qkv_size, cfg.hidden_size), "wo": (n, cfg.hidden_size, cfg.q_size),
              "w_gate": (n, cfg.intermediate_size, cfg.hidden_size), "w_up": (n, cfg.intermediate_size,
                                                                               cfg.hidden_size),
              "w_down": (n, cfg.hidden_size, cfg.intermediate_size), "embed": (cfg.vocab_size, cfg.hidden_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    if cfg.qkv_bias:
        shapes["bqkv"] = (n, cfg.qkv_size)
    if cfg.qk_norm:
        shapes["qk_norm"] = (n, 2 * cfg.hd)
    for name, shape in shapes.items():
        if tuple(out[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(out[name].shape)}, expected {shape}")
    return out


class ResidualOverflow(RuntimeError):
    """A step's logits are not finite on a build whose residual stream x is fp16 (`StreamConfig.x_dtype`): x
    probably passed fp16's 65504."""


class Megakernel:
    """A compiled persistent interpreter for one model config, its weights, KV cache and workspace."""

    def __init__(self, schedule: Schedule | ScheduleSet, weights: dict[str, torch.Tensor], *,
                 max_seq_len: int | None = None, trace: bool = False, device: str | torch.device = "cuda",
                 timeout_s: float = 2.0, config: Any = None) -> None:
        chosen = schedule
        if isinstance(schedule, ScheduleSet):
            schedule = schedule.schedules[0]  # every member has the same model and KV cache
        if schedule.model is None:
            raise ScheduleError("the GPU interpreter needs a schedule with `model`", "$.model")
        self.cfg = ModelConfig.from_hf(schedule.model.config)
        self.device = torch.device(device)
        self.max_seq_len = int(max_seq_len or schedule.model.max_seq_len)
        #: Sequences per step: each its own KV cache slot, token and position (rt = tokens, then positions), its
        #: part of every activation buffer, and [B, V] logits. Interpreter v10 runs a batch within
        #: `stream.batch_limits` (Megakernel's default on Hopper), v9 any batch.
        self.batch = int(schedule.model.batch or 1)
        b = self.batch
        if self.device.type == "cuda":  # a long context's KV cache can pass the GPU: say so before touching it
            check_fits(gpu_memory_parts(self.cfg, self.max_seq_len, batch=b), torch.cuda.mem_get_info(self.device)[0])
        self.trace = trace
        self.timeout_ns = int(timeout_s * 1e9)
        self.kcfg = config or default_config(self.device, self.cfg, b)
        self.v10 = not isinstance(self.kcfg, KernelConfig)  # a megasynth.kernels.gpu.stream.StreamConfig
        c = self.cfg
        self.geo: dict[str, Any] = {}  # v10: the build's geometry (`stream_geometry`)
        if self.v10:
            from megasynth.kernels.gpu.stream import stream_geometry

            try:
                self.geo = stream_geometry(c, self.kcfg, b)
            except ValueError as exc:  # a batch this interpreter cannot build for the model
                raise ScheduleError(f"{exc}; interpreter v9 (KernelConfig) runs it", "$.model.batch") from None
        # On the CPU (Triton's interpreter, TRITON_INTERPRET=1) programs run one after another: one worker only.
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        self.w = stack_weights(c, weights, self.device)
        shape = (c.num_hidden_layers, *((b,) if b > 1 else ()), c.num_key_value_heads, self.max_seq_len, c.hd)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        xdt = torch.float16 if self.geo.get("X_DTYPE") == "fp16" else torch.float32  # `StreamConfig.x_dtype`
        self.x = torch.zeros(b * c.hidden_size, dtype=xdt, device=self.device)
        self.q = torch.zeros(b * c.q_size, **f32)
        # attn and act in bf16 where a v10 batch stages them in bf16 anyway (`StreamConfig.act_bf16`)
        acts = dict(f32, dtype=torch.bfloat16) if self.v10 and self.geo["ACT_BF16"] else f32
        self.attn = torch.zeros(b * c.q_size, **acts)
        self.act = torch.zeros(b * c.intermediate_size, **acts)
        self.logits = torch.zeros(b * c.vocab_size, **f32)
        # QK-norm applied after QKV (v10): per-pair sums of squares of every q and k head, and the new k rows
        # before their per-head scale (the catalogue's `qk_sq` and `k_new`, one part per sequence); other models pass
        # `q` as a stand-in the kernel never reads (its build has that code compiled out: QK_NORM)
        if c.qk_norm:
            self.qk_sq = torch.zeros(b * (c.num_attention_heads + c.num_key_value_heads) * c.hd // 2, **f32)
            self.k_new = torch.zeros(b * c.kv_size, **f32)
        else:
            self.qk_sq = self.k_new = self.q
        angles = np.arange(self.max_seq_len, dtype=np.float64)[:, None] * np.array(rope_inv_freq(c))[None, :]
        self.cos = torch.tensor(np.cos(angles), **f32).contiguous()
        self.sin = torch.tensor(np.sin(angles), **f32).contiguous()
        self.rt = torch.zeros(2 * b, dtype=torch.int32, device=self.device)
        self._rt_host = torch.zeros(2 * b, dtype=torch.int32).pin_memory() if self.device.type == "cuda" else None
        self.smids = torch.zeros(self.num_sms, dtype=torch.int32, device=self.device)
        # a v9 batch build's per-program scratch for the staged operand of its weight ops (ops.stage_batch); other
        # builds pass a stand-in they never read
        vsw = 0 if self.v10 else staging_elements(c, self.kcfg, b)
        self.vs = torch.zeros(self.num_sms * vsw, dtype=torch.bfloat16, device=self.device) if vsw else self.k_cache
        self.descs: list[Any] = []  # v10: TMA descriptors of the weights and the KV cache (built once: they never move)
        if self.v10:
            from megasynth.kernels.gpu.stream import stream_descriptors

            self.descs = stream_descriptors(c, self.w, self.k_cache, self.v_cache, self.geo)
        self.compiled: Any = None
        self.occupancy: dict[str, Any] = {}
        self.packed: Packed | None = None
        self.members: list[Packed] = []  # a schedule set's members, packed (in `schedule_set`'s order)
        self.schedule_set: ScheduleSet | None = None
        self.set_schedule(chosen)

    # -- schedule tables -------------------------------------------------------------------------------------

    def pack(self, schedule: Schedule) -> Packed:
        """Resolve + pack a schedule and copy its tables (and its own counters/workspace) to the device."""
        if schedule.model is None or ModelConfig.from_hf(schedule.model.config) != self.cfg:
            raise ScheduleError("the schedule's model config differs from this Megakernel's", "$.model.config")
        p = pack(schedule, "v10" if self.v10 else "v9")
        if not self.v10:
            check_runs_on_v9(p, self.cfg.hd, "lower it for a batch's interpreter v9 (whole-head QKV tiles, no "
                             "fuse_attn_reduce, a QK-norm inside QKV: the strategy's qk_norm in_qkv)"
                             if self.batch > 1 else "run it on interpreter v10 (StreamConfig)")
        elif self.batch > 1:
            check_runs_batched_on_v10(p, qk_pairs=self.cfg.qk_norm and not self.geo["QKH"],
                                      x16=self.geo["X_DTYPE"] == "fp16")
        elif self.geo["MMA"]:
            check_mma_k_starts(p)
        else:
            check_k_ranges(p, self.cfg)
        if p.workers > self.num_sms:
            raise ScheduleError(f"{p.workers} workers but the GPU has {self.num_sms} SMs: a persistent grid larger "
                                "than the machine deadlocks", "$.queues")
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        c = self.cfg
        p.device = {
            "ins": torch.tensor(p.ins.reshape(-1), **i32), "waits": torch.tensor(p.waits.reshape(-1), **i32),
            "sigs": torch.tensor(p.sigs.reshape(-1), **i32), "qoff": torch.tensor(p.qoff, **i32),
            "qitems": torch.tensor(p.qitems, **i32),
            "counters": torch.zeros(max(p.counters, 1), **i32),
            "err": torch.zeros(max(p.workers, 1) * ERR_FIELDS, **i32),
            "opart": torch.zeros(self.batch * p.max_splits * c.q_size, dtype=torch.float32, device=dev),
            "lse": torch.zeros(self.batch * p.max_splits * c.num_attention_heads, dtype=torch.float32, device=dev),
            "trace": torch.zeros((max(p.n, 1), TRACE_FIELDS), dtype=torch.int64, device=dev),
            "graph": None,
        }
        return p

    def set_schedule(self, schedule: Schedule | ScheduleSet) -> Packed:
        """Make `schedule` the one `step` runs, or a set's members the ones it picks from by position (no recompile:
        only the tables change)."""
        if isinstance(schedule, ScheduleSet):
            if schedule.max_seq_len > self.max_seq_len:
                raise ScheduleError(f"the set covers positions up to {schedule.max_seq_len}, the KV cache "
                                    f"{self.max_seq_len}", "$.ranges", schedule.file)
            self.members = [self.pack(s) for s in schedule.schedules]
            self.schedule_set = schedule
            self.packed = self.members[0]
        else:
            self.members, self.schedule_set = [], None
            self.packed = self.pack(schedule)
        return self.packed

    def member_for(self, pos: int | Sequence[int]) -> Packed:
        """The packed schedule that serves KV position `pos` (a batch: its furthest position): a set's member whose
        range holds it, else the one schedule."""
        assert self.packed is not None
        if self.schedule_set is None:
            return self.packed
        return self.members[self.schedule_set.index(pos if isinstance(pos, int) else max(pos))]

    # -- launching ---------------------------------------------------------------------------------------------

    def _args(self, p: Packed, trace: bool) -> tuple[Any, list[Any], dict[str, Any]]:
        """The kernel to launch (v9 or v10), its runtime arguments and its compile-time parameters."""
        d, w, c, k = p.device, self.w, self.cfg, self.kcfg
        # the family's extra weights; a model without them passes a stand-in the kernel never reads (its build has
        # the code compiled out: QKV_BIAS / QK_NORM)
        extra = [w.get("bqkv", w["attn_norm"]), w.get("qk_norm", w["attn_norm"])]
        if self.v10:
            from megasynth.kernels.gpu.stream import stream_constexprs, stream_megakernel

            args = [d["ins"], d["waits"], d["sigs"], d["qoff"], d["counters"], d["err"], d["trace"], self.smids,
                    self.rt, w["embed"], w["attn_norm"], w["mlp_norm"], w["final_norm"], *extra, *self.descs,
                    w["wqkv"], w["wo"], w["w_gate"], w["w_up"], w["w_down"], w["lm_head"], self.x, self.q,
                    self.k_cache, self.v_cache, d["opart"], d["lse"], self.attn, self.act,
                    self.logits, self.cos, self.sin, self.qk_sq, self.k_new, self.timeout_ns, p.max_splits]
            return stream_megakernel, args, stream_constexprs(c, self.max_seq_len, k, trace, self.batch)
        args = [d["ins"], d["waits"], d["sigs"], d["qoff"], d["qitems"], d["counters"], d["err"], d["trace"],
                self.smids, self.rt, w["embed"], w["attn_norm"], w["wqkv"], w["wo"], w["mlp_norm"], w["w_gate"],
                w["w_up"], w["w_down"], w["final_norm"], w["lm_head"], *extra, self.x, self.q, self.k_cache,
                self.v_cache, d["opart"], d["lse"], self.attn, self.act, self.logits, self.cos, self.sin, self.vs,
                self.timeout_ns, p.max_splits]
        return v9_megakernel, args, kernel_constexprs(c, self.max_seq_len, k, trace, self.batch)

    def _check_residency(self, p: Packed, trace: bool) -> None:
        """Compile (once per trace flag) and refuse a grid whose programs cannot all be resident at once."""
        key = ("compiled", trace)
        if self.device.type != "cuda":
            return
        if key not in self.occupancy:
            fn, args, consts = self._args(p, trace)
            kern = fn.warmup(*args, grid=(1,), **consts)
            if hasattr(kern, "_init_handles"):
                kern._init_handles()
            regs = int(getattr(kern, "n_regs", 0))
            smem = int(getattr(kern.metadata, "shared", 0))
            threads = 32 * self.kcfg.num_warps + (128 if self.v10 else 0)  # v10: + the loader's warpgroup
            props = torch.cuda.get_device_properties(self.device)
            regs_per_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
            smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 233472))
            per_block_regs = -(-regs * threads // 256) * 256 if regs else 0
            by_regs = regs_per_sm // per_block_regs if per_block_regs else 32
            by_smem = smem_per_sm // (smem + 1024) if smem else 32
            per_sm = min(by_regs, by_smem, 2048 // threads)
            self.occupancy[key] = {"regs": regs, "spills": int(getattr(kern, "n_spills", 0)), "shared_bytes": smem,
                                   "threads": threads, "ctas_per_sm": per_sm, "sms": self.num_sms}
        occ = self.occupancy[key]
        if occ["ctas_per_sm"] < 1 or p.workers > occ["ctas_per_sm"] * self.num_sms or p.workers > self.num_sms:
            raise RuntimeError(f"{p.workers} workers cannot all be resident: {occ}")

    def set_position(self, token: int | Sequence[int], pos: int | Sequence[int]) -> None:
        """Write token and KV position into the device-side runtime inputs (read by the kernel and its graphs); a
        batch gives one of each per sequence. With a schedule set, make the member whose range holds `pos` the one
        that runs."""
        c = self.cfg
        tokens = [token] if isinstance(token, int) else [int(t) for t in token]
        positions = [pos] if isinstance(pos, int) else [int(p) for p in pos]
        if not len(tokens) == len(positions) == self.batch:
            raise ValueError(f"{len(tokens)} tokens and {len(positions)} positions for a batch of {self.batch}")
        for t in tokens:
            if not 0 <= t < c.vocab_size:
                raise ValueError(f"token {t} outside the vocabulary [0, {c.vocab_size})")
        for p in positions:
            if not 0 <= p < self.max_seq_len:
                raise ValueError(f"pos {p} outside the KV cache [0, {self.max_seq_len})")
        self.packed = self.member_for(max(positions))
        if self._rt_host is not None:
            for i, value in enumerate(tokens + positions):
                self._rt_host[i] = value
            self.rt.copy_(self._rt_host, non_blocking=True)
        else:
            self.rt.copy_(torch.tensor(tokens + positions, dtype=torch.int32))

    def uniform_inputs(self, token: int, pos: int) -> tuple[int | list[int], int | list[int]]:
        """`set_position`'s arguments for every sequence at `pos`: token, pos at batch 1; sequence b gets token + b
        (its own input, as `synth bench` gives each its own) and pos in a batch."""
        if self.batch == 1:
            return token, pos
        return [(token + b) % self.cfg.vocab_size for b in range(self.batch)], [pos] * self.batch

    def launch(self, packed: Packed | None = None, token: int | None = None, pos: int | None = None, *,
               reset: bool = True, trace: bool | None = None) -> None:
        """Enqueue one run of `packed` on the current stream (counter reset first unless `reset=False`); no sync."""
        if token is not None and pos is not None:
            self.set_position(token, pos)  # (with a schedule set, this picks the member `packed` defaults to)
        p = packed or self.packed
        assert p is not None
        trace = self.trace if trace is None else trace
        self._check_residency(p, trace)
        if reset and p.counters > 0:  # (a schedule without counters, e.g. one stage of the ablation, needs none)
            p.device["counters"].zero_()
        fn, args, consts = self._args(p, trace)
        fn[(p.workers,)](*args, **consts)

    def check(self, packed: Packed | None = None) -> None:
        """Raise `WatchdogError` naming every stuck worker, instruction and counter of the last run (syncs)."""
        p = packed or self.packed
        assert p is not None
        if self.device.type == "cuda":
            wait_for_gpu("the megakernel's step", self.device)
        err = p.device["err"].view(-1, ERR_FIELDS)
        flags = err[:, 0]
        if int(flags.max().item()) == 0:
            return
        rows = err[flags != 0].cpu().tolist()
        p.device["err"].zero_()
        where = {i: k for k, i in enumerate(p.ids)}
        lines = []
        for _, worker, ident, counter, cur, need, sm, _ in rows[:8]:
            label = p.labels[where[ident]] if ident in where else f"#{ident}"
            lines.append(f"worker {worker} (SM {sm}) stuck at {label}: counter {counter} = {cur}, needs {need}")
        more = f" (+{len(rows) - 8} more)" if len(rows) > 8 else ""
        raise WatchdogError(f"watchdog timeout after {self.timeout_ns / 1e9:g} s: " + "; ".join(lines) + more)

    def graph(self, packed: Packed | None = None) -> torch.cuda.CUDAGraph:
        """The CUDA graph of one whole step of `packed`: counter reset + the kernel (captured once, replayed)."""
        p = packed or self.packed
        assert p is not None
        if p.device.get("graph") is None:
            self.launch(p)  # compile and warm up outside the capture
            wait_for_gpu("the megakernel's first run of this schedule", self.device)
            self.check(p)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.launch(p)
            p.device["graph"] = g
        return p.device["graph"]

    def step(self, token: int | Sequence[int], pos: int | Sequence[int]) -> torch.Tensor:
        """One decode step (CUDA-graph replay); returns a copy of the fp32 logits ([V], or [B, V] for a batch, which
        gives a token and a position per sequence). Raises `WatchdogError` on a hang, and `ResidualOverflow` where
        the residual stream is fp16 and the logits are not finite."""
        self.set_position(token, pos)
        p = self.packed
        if self.device.type == "cuda":
            self.graph(p).replay()
        else:
            self.launch(p)
        out = self.logits.clone()
        self.check(p)
        if self.x.dtype == torch.float16 and not bool(torch.isfinite(out).all()):
            raise ResidualOverflow("the logits are not finite: this batch build keeps the residual stream x in fp16 "
                                  "(StreamConfig.x_dtype), which a checkpoint's activations past 65504 overflow; "
                                  "build it in fp32 with --kernel-option x_dtype=fp32")
        return out.view(self.batch, -1) if self.batch > 1 else out

    def counters(self, packed: Packed | None = None) -> np.ndarray:
        p = packed or self.packed
        assert p is not None
        return p.device["counters"][:p.counters].cpu().numpy()

    def raw_trace(self, packed: Packed | None = None) -> np.ndarray:
        """[N, 4] int64 (wait start, start, end ns; worker) of the last traced run, by instruction index."""
        p = packed or self.packed
        assert p is not None
        return p.device["trace"][:p.n, :4].cpu().numpy()

    def raw_loader_trace(self, packed: Packed | None = None) -> np.ndarray:
        """[N, 2] int64 ns of the last traced run on v10, by instruction index: when the loader reached the
        instruction (every earlier fill of its worker issued) and when it issued the instruction's last fill (both
        the same for an instruction without fills). Zeros on v9."""
        p = packed or self.packed
        assert p is not None
        return p.device["trace"][:p.n, 4:6].cpu().numpy()

    def raw_phase_trace(self, packed: Packed | None = None) -> np.ndarray:
        """[N, 2] int64 ns of the last traced run on v10, by instruction index: when the compute warps had staged the
        instruction's activations (0 for the ops without a stage: the embedding, attention, attn_reduce) and when
        its op ended, before its signals. Zeros on v9."""
        p = packed or self.packed
        assert p is not None
        return p.device["trace"][:p.n, 6:8].cpu().numpy()

    def traced_step(self, token: int | Sequence[int], pos: int | Sequence[int],
                    metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one step with timestamps (plain launch, trace-enabled kernel) and return the Chrome trace dict (a
        batch: one token and position per sequence; ctx is the longest sequence's)."""
        from megasynth.trace import from_raw, schedule_sha256

        self.set_position(token, pos)
        pos = pos if isinstance(pos, int) else max(int(q) for q in pos)
        p = self.packed
        assert p is not None
        p.device["trace"].zero_()
        self.launch(p, trace=True)
        if self.device.type == "cuda":
            wait_for_gpu("the megakernel's traced step", self.device)
        self.check(p)
        sched = p.schedule
        meta = {"model": sched.model.name if sched is not None and sched.model is not None else None,
                "device": (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                           else "cpu (interpreter)"),
                "ctx": pos + 1, "estimated": False,
                "schedule_sha256": schedule_sha256(sched.to_json()) if sched is not None else None,
                "launch": "plain launch of the trace-enabled kernel (timestamps from %globaltimer)",
                **(metadata or {})}
        return from_raw(self.raw_trace(p), p.ids, p.ops, p.layers, meta)
