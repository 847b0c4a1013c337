"""The persistent Triton megakernel: one program per SM walks its queue of a packed schedule (kernels/gpu/pack.py).

Per instruction: wait on its counters with acquire loads (bounded by a `%globaltimer` watchdog: on timeout the program
records worker, instruction id, counter, current and needed value in an error buffer and exits; the host raises
`WatchdogError`), dispatch on the opcode to the op's Triton code (kernels/gpu/ops.py), CTA barrier, then signal with a
release atomic at GPU scope from one thread. The schedule is data (int32 tables): a new assignment, order or counter
layout needs no recompile; token and KV position are read from a device tensor, so one CUDA graph serves every step.

`Megakernel.step(token, pos)` replays a CUDA graph holding the whole step: counter reset + the kernel (embedding,
all layers, the LM head). Static queues deadlock unless every program is resident at once, so the grid is checked
against the SM count and the compiled kernel's occupancy before the first launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from megasynth.ir.catalogue import FUSED_OPROJ, rope_inv_freq
from megasynth.ir.errors import ScheduleError
from megasynth.ir.model import ModelConfig
from megasynth.ir.schedule import Schedule
from megasynth.kernels.gpu import ops
from megasynth.kernels.gpu.pack import F_A0, F_OP, OPCODES, ROW, TRACE_FIELDS, Packed, pack

OP_EMBED: tl.constexpr = tl.constexpr(OPCODES["embed"])
OP_QKV: tl.constexpr = tl.constexpr(OPCODES["attn_norm_qkv_rope"])
OP_PARTIAL: tl.constexpr = tl.constexpr(OPCODES["attn_partial"])
OP_REDUCE: tl.constexpr = tl.constexpr(OPCODES["attn_reduce"])
OP_OPROJ: tl.constexpr = tl.constexpr(OPCODES["o_proj_residual"])
OP_GATE_UP: tl.constexpr = tl.constexpr(OPCODES["mlp_norm_gate_up"])
OP_DOWN: tl.constexpr = tl.constexpr(OPCODES["down_proj_residual"])
OP_LM_HEAD: tl.constexpr = tl.constexpr(OPCODES["final_norm_lm_head"])
TRACE_W: tl.constexpr = tl.constexpr(TRACE_FIELDS)  # int64 fields per trace row
ERR_FIELDS = 8  # flag, worker, instruction id, counter, current, needed, smid, 0


class WatchdogError(RuntimeError):
    """A worker waited past the watchdog timeout: the schedule (or the kernel) would have hung the GPU."""


@triton.jit
def _load_row(ins_ptr, q, q1, ROWW: tl.constexpr):
    """The fields of queue row q (kernels/gpu/pack.py's layout); past the queue's end (q >= q1) opcode -1, no hints."""
    valid = q < q1
    row = ins_ptr + q * ROWW
    return (tl.load(row, mask=valid, other=-1), tl.load(row + 1, mask=valid, other=0),
            tl.load(row + 2, mask=valid, other=0), tl.load(row + 3, mask=valid, other=0),
            tl.load(row + 4, mask=valid, other=0), tl.load(row + 5, mask=valid, other=0),
            tl.load(row + 6, mask=valid, other=0), tl.load(row + 7, mask=valid, other=0),
            tl.load(row + 8, mask=valid, other=0), tl.load(row + 9, mask=valid, other=0),
            tl.load(row + 10, mask=valid, other=0), tl.load(row + 11, mask=valid, other=0),
            tl.load(row + 12, mask=valid, other=0), tl.load(row + 13, mask=valid, other=0),
            tl.load(row + 14, mask=valid, other=0), tl.load(row + 15, mask=valid, other=0),
            tl.load(row + 16, mask=valid, other=-1), tl.load(row + 17, mask=valid, other=-1))


@triton.jit
def _megakernel(
    ins_ptr, waits_ptr, sigs_ptr, qoff_ptr, qitems_ptr, counters_ptr, err_ptr, trace_ptr, smid_ptr, rt_ptr,
    embed_ptr, attn_norm_ptr, wqkv_ptr, wo_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, wd_ptr, final_norm_ptr, lm_head_ptr,
    x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr,
    timeout_ns,
    H: tl.constexpr, IS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
    EPS: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr, GP: tl.constexpr,
    BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr, BR_GU: tl.constexpr, BK_GU: tl.constexpr,
    BR_D: tl.constexpr, BK_D: tl.constexpr, BR_LM: tl.constexpr, BK_LM: tl.constexpr, BT: tl.constexpr,
    BE: tl.constexpr, NS: tl.constexpr, TRACE: tl.constexpr, ROWW: tl.constexpr, PREFETCH: tl.constexpr,
    ATTN_MMA: tl.constexpr, NS_ATTN: tl.constexpr, PF_CAP: tl.constexpr, WB: tl.constexpr,
    FLAT: tl.constexpr, BR_GU2: tl.constexpr, BK_GU2: tl.constexpr, SP: tl.constexpr, WARM_O: tl.constexpr,
    WARM_GU: tl.constexpr,
):
    QS: tl.constexpr = NH * HD
    KVS: tl.constexpr = NKV * HD
    G: tl.constexpr = NH // NKV
    pid = tl.program_id(0)
    tl.store(smid_ptr + pid, ops.smid())
    qi = tl.load(qoff_ptr + pid)
    q1 = tl.load(qoff_ptr + pid + 1)
    token = tl.load(rt_ptr)
    pos = tl.load(rt_ptr + 1)
    ok = pid * 0 + 1
    # The current row's fields are loaded one instruction ahead (software-pipelined decode): rows are in queue order,
    # so the next row's address needs no load and its latency hides behind the current instruction.
    (op, layer, a0, a1, a2, a3, iid, woff, wn, soff, sn, c0, v0, sc0, sa0, idx, warm_o,
     warm_gu) = _load_row(ins_ptr, qi, q1, ROWW)
    while (qi < q1) & (ok != 0):
        (n_op, n_layer, n_a0, n_a1, n_a2, n_a3, n_iid, n_woff, n_wn, n_soff, n_sn, n_c0, n_v0, n_sc0, n_sa0, n_idx,
         n_warm_o, n_warm_gu) = _load_row(ins_ptr, qi + 1, q1, ROWW)
        if PREFETCH >= 1:  # weights never depend on a wait: start streaming (the head of) them into L2 now
            ops.prefetch_instruction(op, layer, a0, a1, a2, a3, pos, wqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr,
                                     lm_head_ptr, kc_ptr, vc_ptr, H, IS, NH, NKV, HD, S, OP_QKV, OP_PARTIAL,
                                     OP_OPROJ, OP_GATE_UP, OP_DOWN, OP_LM_HEAD, PF_CAP)
        # L2 warm-up (pack.warm_hints): the first instruction of a layer on this worker starts pulling the weights of
        # its later o_proj (all of it) and gate/up (the first WARM_GU rows) into L2, while the attention chain
        # leaves HBM mostly idle; the hint is a prefetch, so it changes no result.
        if WARM_O:
            if warm_o >= 0:
                trow = ins_ptr + warm_o * ROWW
                ops.prefetch_rows(wo_ptr, tl.load(trow + 1).to(tl.int64) * H * QS, QS, tl.load(trow + 2),
                                  tl.load(trow + 3), tl.load(trow + 4), tl.load(trow + 5), 1 << 30)
        if WARM_GU > 0:
            if warm_gu >= 0:
                trow = ins_ptr + warm_gu * ROWW
                goff = tl.load(trow + 1).to(tl.int64) * IS * H
                g0 = tl.load(trow + 2)
                g1 = tl.minimum(tl.load(trow + 3), g0 + WARM_GU)
                ops.prefetch_rows(wg_ptr, goff, H, g0, g1, g0 * 0, g0 * 0 + H, 1 << 30)
                ops.prefetch_rows(wu_ptr, goff, H, g0, g1, g0 * 0, g0 * 0 + H, 1 << 30)
        if TRACE:
            t_wait = ops.globaltimer()
        if wn == 1:  # the common case: one wait, inline in the row, one acquire load per poll
            cur = ops.load_acquire(counters_ptr + c0)
            if cur < v0:
                t0 = ops.globaltimer()
                elapsed = t0 - t0
                while (cur < v0) & (elapsed < timeout_ns):
                    cur = ops.load_acquire(counters_ptr + c0)
                    elapsed = ops.globaltimer() - t0
                if cur < v0:
                    ops.report_stuck(err_ptr, pid, iid, c0, cur, v0)
                    ok = pid * 0
        elif wn > 1:  # several waits: poll WB counters at once (one round trip), spin on the unsatisfied ones
            wb = woff * 0
            while (wb < wn) & (ok != 0):
                lanes = wb + tl.arange(0, WB)
                lm = lanes < wn
                cs = tl.load(waits_ptr + 2 * (woff + lanes), mask=lm, other=0)
                nd = tl.load(waits_ptr + 2 * (woff + lanes) + 1, mask=lm, other=0)
                curs = ops.load_acquire(counters_ptr + cs)
                short = tl.sum((curs < nd).to(tl.int32), 0)
                if short > 0:
                    t0 = ops.globaltimer()
                    elapsed = t0 - t0
                    while (short > 0) & (elapsed < timeout_ns):
                        curs = ops.load_acquire(counters_ptr + cs)
                        short = tl.sum((curs < nd).to(tl.int32), 0)
                        elapsed = ops.globaltimer() - t0
                    if short > 0:
                        bad = tl.min(tl.where(curs < nd, lanes, wn), 0)
                        sel = lanes == bad
                        ops.report_stuck(err_ptr, pid, iid, tl.sum(tl.where(sel, cs, 0), 0),
                                         tl.sum(tl.where(sel, curs, 0), 0), tl.sum(tl.where(sel, nd, 0), 0))
                        ok = pid * 0
                wb += WB
            tl.debug_barrier()  # each thread polled some lanes: order every thread's reads after all acquires
        if ok != 0:
            if TRACE:
                t_start = ops.globaltimer()
            if op == OP_EMBED:
                ops.op_embed(embed_ptr, x_ptr, token, a0, a1, H, BE)
            elif op == OP_QKV:
                ops.op_qkv_rope(x_ptr, attn_norm_ptr, wqkv_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, layer,
                                a0, a1, pos, H, NKV, HD, QS, KVS, S, BLOCK_H, EPS, BK_QKV, NS)
            elif op == OP_PARTIAL:
                if ATTN_MMA:
                    ops.op_attn_partial_mma(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, layer, a0, a1, a2, pos,
                                            NH, NKV, HD, S, G, BT, SCALE, NS_ATTN)
                else:
                    ops.op_attn_partial(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, layer, a0, a1, a2, pos,
                                        NH, NKV, HD, S, G, GP, BT, SCALE)
            elif op == OP_REDUCE:
                ops.op_attn_reduce(opart_ptr, lse_ptr, attn_ptr, a0, a1, a2, NH, HD, GP, SP)
            elif op == OP_OPROJ:
                ops.op_matvec_residual(wo_ptr, attn_ptr, x_ptr, layer, a0, a1, a2, a3, H, QS, BR_O, BK_O, NS)
            elif op == OP_GATE_UP:
                if FLAT and (H % BK_GU == 0) and (H % BK_GU2 == 0):
                    if (a1 - a0) % BR_GU == 0:
                        ops.op_gate_up_flat(x_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, act_ptr, layer, a0, a1, H, IS, EPS,
                                            BR_GU, BK_GU, NS)
                    else:  # tiles that are not a multiple of BR_GU rows: a narrower tile wastes no masked rows
                        ops.op_gate_up_flat(x_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, act_ptr, layer, a0, a1, H, IS, EPS,
                                            BR_GU2, BK_GU2, NS)
                else:
                    ops.op_gate_up(x_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, act_ptr, layer, a0, a1, H, IS, BLOCK_H,
                                   EPS, BR_GU, BK_GU, NS)
            elif op == OP_DOWN:
                ops.op_matvec_residual(wd_ptr, act_ptr, x_ptr, layer, a0, a1, a2, a3, H, IS, BR_D, BK_D, NS)
            elif op == OP_LM_HEAD:
                if FLAT and (H % BK_LM == 0):
                    ops.op_lm_head_flat(x_ptr, final_norm_ptr, lm_head_ptr, logits_ptr, a0, a1, H, EPS, BR_LM,
                                        BK_LM, NS)
                else:
                    ops.op_lm_head(x_ptr, final_norm_ptr, lm_head_ptr, logits_ptr, a0, a1, H, BLOCK_H, EPS, BR_LM,
                                   BK_LM, NS)
            tl.debug_barrier()
            si = soff * 0
            while si < sn:
                sc = sc0
                sa = sa0
                if si > 0:
                    sc = tl.load(sigs_ptr + 2 * (soff + si))
                    sa = tl.load(sigs_ptr + 2 * (soff + si) + 1)
                ops.signal_release(counters_ptr + sc, sa)
                si += 1
            if TRACE:
                t_end = ops.globaltimer()
                tr = trace_ptr + idx.to(tl.int64) * TRACE_W
                tl.store(tr, t_wait)
                tl.store(tr + 1, t_start)
                tl.store(tr + 2, t_end)
                tl.store(tr + 3, pid.to(tl.int64))
        qi += 1
        (op, layer, a0, a1, a2, a3, iid, woff, wn, soff, sn, c0, v0, sc0, sa0, idx, warm_o,
         warm_gu) = (n_op, n_layer, n_a0, n_a1, n_a2, n_a3, n_iid, n_woff, n_wn, n_soff, n_sn, n_c0, n_v0, n_sc0,
                     n_sa0, n_idx, n_warm_o, n_warm_gu)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time tile shapes and pipelining of the interpreter (none of them depend on the schedule)."""

    num_warps: int = 8
    num_stages: int = 4  # software-pipelining depth of the weight-streaming K loops (3 until v9)
    bk_qkv: int = 256
    br_o: int = 16
    bk_o: int = 512
    br_gu: int = 32  # 2 x [32, 256] bf16 tiles per stage (measured: better than 16 x 512, perf-notes v5)
    bk_gu: int = 256
    br_gu2: int = 16  # gate/up tiles whose row count is not a multiple of br_gu use br_gu2 x bk_gu2
    bk_gu2: int = 512
    br_d: int = 16
    bk_d: int = 512
    br_lm: int = 32
    bk_lm: int = 512
    bt: int = 64  # KV positions per attention block
    attn_mma: bool = True  # attention on the tensor cores (hi/lo bf16 split) instead of fp32 broadcast-reduce
    ns_attn: int = 3  # pipelining depth of the K/V stream (tensor-core attention)
    prefetch: int = 0  # L2 prefetch of an instruction's weights before its waits: 0 none, 1 yes (up to pf_cap bytes)
    pf_cap: int = 1 << 30  # bytes prefetched per instruction (the head of its weight stream)
    flat: bool = True  # gate/up and LM head: one pipelined loop over (row block, K block), no refill per row block
    be: int = 1024  # embedding copy block
    reduce_splits: int = 16  # attention splits attn_reduce folds with all loads issued at once (perf-notes v8)
    warm_o: bool = False  # L2 warm-up of a worker's o_proj tile at the start of its layer (perf-notes v9)
    warm_gu: int = 0  # rows of a worker's gate/up tile warmed into L2 at the start of its layer (0: none)


def default_config(device: torch.device) -> Any:
    """Interpreter v10 (`megasynth.kernels.gpu.stream.StreamConfig`: TMA, warp specialization) on Hopper and newer GPUs;
    interpreter v9 (`KernelConfig`) elsewhere, Triton's CPU interpreter included (it cannot run Gluon)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        from megasynth.kernels.gpu.stream import StreamConfig

        return StreamConfig()
    return KernelConfig()


def stack_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Catalogue weights -> per-kind stacks across layers (one base pointer + layer offset): matrices bf16, norms
    fp32; a tied LM head shares the embedding's storage."""
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
    out["lm_head"] = out["embed"] if tied else weights["lm_head"].to(device=device, dtype=torch.bfloat16).contiguous()
    shapes = {"wqkv": (n, cfg.qkv_size, cfg.hidden_size), "wo": (n, cfg.hidden_size, cfg.q_size),
              "w_gate": (n, cfg.intermediate_size, cfg.hidden_size), "w_up": (n, cfg.intermediate_size,
                                                                               cfg.hidden_size),
              "w_down": (n, cfg.hidden_size, cfg.intermediate_size), "embed": (cfg.vocab_size, cfg.hidden_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    for name, shape in shapes.items():
        if tuple(out[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(out[name].shape)}, expected {shape}")
    return out


def kernel_constexprs(c: ModelConfig, max_seq_len: int, k: KernelConfig, trace: bool) -> dict[str, Any]:
    """The compile-time parameters of the interpreter for one model config (launch options included). The QKV K tile
    shrinks for wide heads so its two [hd/2, BK] accumulators stay at 16k fp32 (no spills at head_dim 128)."""
    hp = _pow2(c.hidden_size)
    return dict(
        H=c.hidden_size, IS=c.intermediate_size, NH=c.num_attention_heads, NKV=c.num_key_value_heads, HD=c.hd,
        S=max_seq_len, EPS=float(c.rms_norm_eps), SCALE=1.0 / math.sqrt(c.hd), BLOCK_H=hp,
        GP=max(2, _pow2(c.group_size)), BK_QKV=min(k.bk_qkv, hp, max(32, 8192 // max(1, c.hd // 2))),
        BR_O=k.br_o, BK_O=min(k.bk_o, _pow2(c.q_size)),
        BR_GU=k.br_gu, BK_GU=min(k.bk_gu, hp), BR_D=k.br_d, BK_D=min(k.bk_d, _pow2(c.intermediate_size)),
        BR_LM=k.br_lm, BK_LM=min(k.bk_lm, hp), BT=k.bt, BE=min(k.be, hp), NS=k.num_stages, TRACE=trace,
        ROWW=ROW, PREFETCH=k.prefetch, ATTN_MMA=k.attn_mma, NS_ATTN=k.ns_attn, PF_CAP=k.pf_cap, WB=16, FLAT=k.flat,
        BR_GU2=k.br_gu2, BK_GU2=min(k.bk_gu2, hp), SP=max(1, k.reduce_splits), WARM_O=k.warm_o,
        WARM_GU=k.warm_gu,
        num_warps=k.num_warps, num_stages=1)


class Megakernel:
    """A compiled persistent interpreter for one model config, its weights, KV cache and workspace."""

    def __init__(self, schedule: Schedule, weights: dict[str, torch.Tensor], *, max_seq_len: int | None = None,
                 trace: bool = False, device: str | torch.device = "cuda", timeout_s: float = 2.0,
                 config: Any = None) -> None:
        if schedule.model is None:
            raise ScheduleError("the GPU interpreter needs a schedule with `model`", "$.model")
        self.cfg = ModelConfig.from_hf(schedule.model.config)
        self.device = torch.device(device)
        self.max_seq_len = int(max_seq_len or schedule.model.max_seq_len)
        self.trace = trace
        self.timeout_ns = int(timeout_s * 1e9)
        self.kcfg = config or default_config(self.device)
        self.v10 = not isinstance(self.kcfg, KernelConfig)  # a megasynth.kernels.gpu.stream.StreamConfig
        c = self.cfg
        # On the CPU (Triton's interpreter, TRITON_INTERPRET=1) programs run one after another: one worker only.
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 1)
        self.w = stack_weights(c, weights, self.device)
        shape = (c.num_hidden_layers, c.num_key_value_heads, self.max_seq_len, c.hd)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.x = torch.zeros(c.hidden_size, **f32)
        self.q = torch.zeros(c.q_size, **f32)
        self.attn = torch.zeros(c.q_size, **f32)
        self.act = torch.zeros(c.intermediate_size, **f32)
        self.logits = torch.zeros(c.vocab_size, **f32)
        angles = np.arange(self.max_seq_len, dtype=np.float64)[:, None] * np.array(rope_inv_freq(c))[None, :]
        self.cos = torch.tensor(np.cos(angles), **f32).contiguous()
        self.sin = torch.tensor(np.sin(angles), **f32).contiguous()
        self.rt = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._rt_host = torch.zeros(2, dtype=torch.int32).pin_memory() if self.device.type == "cuda" else None
        self.smids = torch.zeros(self.num_sms, dtype=torch.int32, device=self.device)
        self.descs: list[Any] = []  # v10: TMA descriptors of the weights and the KV cache (built once: they never move)
        if self.v10:
            from megasynth.kernels.gpu.stream import stream_descriptors, stream_geometry

            self.descs = stream_descriptors(c, self.w, self.k_cache, self.v_cache, stream_geometry(c, self.kcfg))
        self.compiled: Any = None
        self.occupancy: dict[str, Any] = {}
        self.packed: Packed | None = None
        self.set_schedule(schedule)

    # -- schedule tables -------------------------------------------------------------------------------------

    def pack(self, schedule: Schedule) -> Packed:
        """Resolve + pack a schedule and copy its tables (and its own counters/workspace) to the device."""
        if schedule.model is None or ModelConfig.from_hf(schedule.model.config) != self.cfg:
            raise ScheduleError("the schedule's model config differs from this Megakernel's", "$.model.config")
        p = pack(schedule)
        if not self.v10:  # interpreter v9 computes QKV a whole head at a time and has no fused merge + o_proj
            hd, qkv = OPCODES["attn_norm_qkv_rope"], self.cfg.hd
            pairs = (p.ins[:, F_OP] == hd) & (((p.ins[:, F_A0] % qkv) != 0) | ((p.ins[:, F_A0 + 1] % qkv) != 0))
            fused = p.ins[:, F_OP] == OPCODES[FUSED_OPROJ]
            for bad, why, field in (
                    (pairs, f"needs QKV tiles of whole heads (multiples of head_dim {qkv}); {{}} is not one", "args"),
                    (fused, f"has no {FUSED_OPROJ} (attn_reduce folded into o_proj), which {{}} is", "op")):
                if bad.any():
                    k = int(p.qitems[int(np.argmax(bad))])
                    at = next(j for j, ins in enumerate(schedule.instructions) if ins.id == p.ids[k])
                    raise ScheduleError(f"interpreter v9 {why.format(p.labels[k])}: run it on interpreter v10 "
                                        "(StreamConfig)", f"$.instructions[{at}].{field}")
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
            "opart": torch.zeros(p.max_splits * c.q_size, dtype=torch.float32, device=dev),
            "lse": torch.zeros(p.max_splits * c.num_attention_heads, dtype=torch.float32, device=dev),
            "trace": torch.zeros((max(p.n, 1), TRACE_FIELDS), dtype=torch.int64, device=dev),
            "graph": None,
        }
        return p

    def set_schedule(self, schedule: Schedule) -> Packed:
        """Make `schedule` the one `step` runs (no recompile: only the tables change)."""
        self.packed = self.pack(schedule)
        return self.packed

    # -- launching ---------------------------------------------------------------------------------------------

    def _args(self, p: Packed, trace: bool) -> tuple[Any, list[Any], dict[str, Any]]:
        """The kernel to launch (v9 or v10), its runtime arguments and its compile-time parameters."""
        d, w, c, k = p.device, self.w, self.cfg, self.kcfg
        if self.v10:
            from megasynth.kernels.gpu.stream import stream_constexprs, stream_megakernel

            args = [d["ins"], d["waits"], d["sigs"], d["qoff"], d["counters"], d["err"], d["trace"], self.smids,
                    self.rt, w["embed"], w["attn_norm"], w["mlp_norm"], w["final_norm"], *self.descs, self.x,
                    self.q, self.k_cache, self.v_cache, d["opart"], d["lse"], self.attn, self.act, self.logits,
                    self.cos, self.sin, self.timeout_ns]
            return stream_megakernel, args, stream_constexprs(c, self.max_seq_len, k, trace)
        args = [d["ins"], d["waits"], d["sigs"], d["qoff"], d["qitems"], d["counters"], d["err"], d["trace"],
                self.smids, self.rt, w["embed"], w["attn_norm"], w["wqkv"], w["wo"], w["mlp_norm"], w["w_gate"],
                w["w_up"], w["w_down"], w["final_norm"], w["lm_head"], self.x, self.q, self.k_cache, self.v_cache,
                d["opart"], d["lse"], self.attn, self.act, self.logits, self.cos, self.sin, self.timeout_ns]
        return _megakernel, args, kernel_constexprs(c, self.max_seq_len, k, trace)

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

    def set_position(self, token: int, pos: int) -> None:
        """Write token and KV position into the device-side runtime inputs (read by the kernel and its graphs)."""
        c = self.cfg
        if not 0 <= token < c.vocab_size:
            raise ValueError(f"token {token} outside the vocabulary [0, {c.vocab_size})")
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"pos {pos} outside the KV cache [0, {self.max_seq_len})")
        if self._rt_host is not None:
            self._rt_host[0], self._rt_host[1] = token, pos
            self.rt.copy_(self._rt_host, non_blocking=True)
        else:
            self.rt.copy_(torch.tensor([token, pos], dtype=torch.int32))

    def launch(self, packed: Packed | None = None, token: int | None = None, pos: int | None = None, *,
               reset: bool = True, trace: bool | None = None) -> None:
        """Enqueue one run of `packed` on the current stream (counter reset first unless `reset=False`); no sync."""
        p = packed or self.packed
        assert p is not None
        trace = self.trace if trace is None else trace
        self._check_residency(p, trace)
        if token is not None and pos is not None:
            self.set_position(token, pos)
        if reset and p.counters > 0:  # (a schedule without counters, e.g. one stage of the ablation, needs none)
            p.device["counters"].zero_()
        fn, args, consts = self._args(p, trace)
        fn[(p.workers,)](*args, **consts)

    def check(self, packed: Packed | None = None) -> None:
        """Raise `WatchdogError` naming every stuck worker, instruction and counter of the last run (syncs)."""
        p = packed or self.packed
        assert p is not None
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
            torch.cuda.synchronize(self.device)
            self.check(p)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.launch(p)
            p.device["graph"] = g
        return p.device["graph"]

    def step(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (CUDA-graph replay); returns a copy of the fp32 logits. Raises `WatchdogError` on a hang."""
        self.set_position(token, pos)
        if self.device.type == "cuda":
            self.graph().replay()
        else:
            self.launch()
        out = self.logits.clone()
        self.check()
        return out

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

    def traced_step(self, token: int, pos: int, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one step with timestamps (plain launch, trace-enabled kernel) and return the Chrome trace dict."""
        from megasynth.trace import from_raw, schedule_sha256

        p = self.packed
        assert p is not None
        p.device["trace"].zero_()
        self.launch(p, token, pos, trace=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
