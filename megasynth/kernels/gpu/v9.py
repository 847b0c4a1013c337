"""Interpreter v9: the persistent Triton megakernel (plain Triton; the default where Gluon's interpreter v10 cannot
run: before Hopper, and under Triton's CPU interpreter). One program per SM walks its queue of a packed schedule
(kernels/gpu/pack.py); the host side (weights, tables, launch, CUDA graph, watchdog, trace) is kernels/gpu/runtime.py.

Per instruction: wait on its counters with acquire loads (bounded by a `%globaltimer` watchdog: on timeout the program
records worker, instruction id, counter, current and needed value in an error buffer and exits; the host raises
`WatchdogError`), dispatch on the opcode to the op's Triton code (kernels/gpu/ops.py), CTA barrier, then signal with a
release atomic at GPU scope from one thread (the PTX of the protocol: kernels/gpu/ptx.py). The schedule is data
(int32 tables): a new assignment, order or counter layout needs no recompile; token and KV position are read from a
device tensor, so one CUDA graph serves every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from megasynth.ir.model import ModelConfig
from megasynth.kernels.gpu import ops, ptx
from megasynth.kernels.gpu.pack import OPCODES, ROW, TRACE_FIELDS

OP_EMBED: tl.constexpr = tl.constexpr(OPCODES["embed"])
OP_QKV: tl.constexpr = tl.constexpr(OPCODES["attn_norm_qkv_rope"])
OP_PARTIAL: tl.constexpr = tl.constexpr(OPCODES["attn_partial"])
OP_REDUCE: tl.constexpr = tl.constexpr(OPCODES["attn_reduce"])
OP_OPROJ: tl.constexpr = tl.constexpr(OPCODES["o_proj_residual"])
OP_GATE_UP: tl.constexpr = tl.constexpr(OPCODES["mlp_norm_gate_up"])
OP_DOWN: tl.constexpr = tl.constexpr(OPCODES["down_proj_residual"])
OP_LM_HEAD: tl.constexpr = tl.constexpr(OPCODES["final_norm_lm_head"])
TRACE_W: tl.constexpr = tl.constexpr(TRACE_FIELDS)  # int64 fields per trace row


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
def v9_megakernel(
    ins_ptr, waits_ptr, sigs_ptr, qoff_ptr, qitems_ptr, counters_ptr, err_ptr, trace_ptr, smid_ptr, rt_ptr,
    embed_ptr, attn_norm_ptr, wqkv_ptr, wo_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, wd_ptr, final_norm_ptr, lm_head_ptr,
    bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr,
    cos_ptr, sin_ptr, vs_ptr,
    timeout_ns, seq_splits,
    H: tl.constexpr, IS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
    EPS: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr, GP: tl.constexpr,
    BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr, BR_GU: tl.constexpr, BK_GU: tl.constexpr,
    BR_D: tl.constexpr, BK_D: tl.constexpr, BR_LM: tl.constexpr, BK_LM: tl.constexpr, BT: tl.constexpr,
    BE: tl.constexpr, NS: tl.constexpr, TRACE: tl.constexpr, ROWW: tl.constexpr, PREFETCH: tl.constexpr,
    ATTN_MMA: tl.constexpr, NS_ATTN: tl.constexpr, PF_CAP: tl.constexpr, WB: tl.constexpr,
    FLAT: tl.constexpr, BR_GU2: tl.constexpr, BK_GU2: tl.constexpr, SP: tl.constexpr, WARM_O: tl.constexpr,
    WARM_GU: tl.constexpr, QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BATCH: tl.constexpr, BB: tl.constexpr,
    VOCAB: tl.constexpr, BKB: tl.constexpr, BATCH_MMA: tl.constexpr, NSB: tl.constexpr, VSK: tl.constexpr,
    BATCH_WF: tl.constexpr,
):
    QS: tl.constexpr = NH * HD
    KVS: tl.constexpr = NKV * HD
    G: tl.constexpr = NH // NKV
    pid = tl.program_id(0)
    tl.store(smid_ptr + pid, ptx.smid())
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
            if BATCH == 1:  # (a batch's positions are per sequence: no KV prefetch at one pos)
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
            t_wait = ptx.globaltimer()
        if wn == 1:  # the common case: one wait, inline in the row, one acquire load per poll
            cur = ptx.load_acquire(counters_ptr + c0)
            if cur < v0:
                t0 = ptx.globaltimer()
                elapsed = t0 - t0
                while (cur < v0) & (elapsed < timeout_ns):
                    cur = ptx.load_acquire(counters_ptr + c0)
                    elapsed = ptx.globaltimer() - t0
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
                curs = ptx.load_acquire(counters_ptr + cs)
                short = tl.sum((curs < nd).to(tl.int32), 0)
                if short > 0:
                    t0 = ptx.globaltimer()
                    elapsed = t0 - t0
                    while (short > 0) & (elapsed < timeout_ns):
                        curs = ptx.load_acquire(counters_ptr + cs)
                        short = tl.sum((curs < nd).to(tl.int32), 0)
                        elapsed = ptx.globaltimer() - t0
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
                t_start = ptx.globaltimer()
            if BATCH > 1:  # every sequence of the batch (ops.py's batched ops; attention: one sequence, a3)
                _batched_op(op, layer, a0, a1, a2, a3, rt_ptr, embed_ptr, attn_norm_ptr, wqkv_ptr, wo_ptr,
                            mlp_norm_ptr, wg_ptr, wu_ptr, wd_ptr, final_norm_ptr, lm_head_ptr, bqkv_ptr, qk_norm_ptr,
                            x_ptr, q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr,
                            sin_ptr, vs_ptr + pid.to(tl.int64) * (2 * BB * VSK), seq_splits, H, IS, NH, NKV, HD,
                            S, EPS,
                            SCALE, GP, BR_O, BR_GU, BR_D, BR_LM, BT, BE, NSB,
                            ATTN_MMA, NS_ATTN, SP, QKV_BIAS, QK_NORM, BATCH, BB, VOCAB, BKB, BATCH_MMA, VSK, BATCH_WF)
            elif op == OP_EMBED:
                ops.op_embed(embed_ptr, x_ptr, token, a0, a1, H, BE)
            elif op == OP_QKV:
                ops.op_qkv_rope(x_ptr, attn_norm_ptr, wqkv_ptr, bqkv_ptr, qk_norm_ptr, q_ptr, kc_ptr, vc_ptr,
                                cos_ptr, sin_ptr, layer, a0, a1, pos, H, NKV, HD, QS, KVS, S, BLOCK_H, EPS, BK_QKV,
                                NS, QKV_BIAS, QK_NORM)
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
                ptx.signal_release(counters_ptr + sc, sa)
                si += 1
            if TRACE:
                t_end = ptx.globaltimer()
                tr = trace_ptr + idx.to(tl.int64) * TRACE_W
                tl.store(tr, t_wait)
                tl.store(tr + 1, t_start)
                tl.store(tr + 2, t_end)
                tl.store(tr + 3, pid.to(tl.int64))
        qi += 1
        (op, layer, a0, a1, a2, a3, iid, woff, wn, soff, sn, c0, v0, sc0, sa0, idx, warm_o,
         warm_gu) = (n_op, n_layer, n_a0, n_a1, n_a2, n_a3, n_iid, n_woff, n_wn, n_soff, n_sn, n_c0, n_v0, n_sc0,
                     n_sa0, n_idx, n_warm_o, n_warm_gu)


@triton.jit
def _batched_op(op, layer, a0, a1, a2, a3, rt_ptr, embed_ptr, attn_norm_ptr, wqkv_ptr, wo_ptr, mlp_norm_ptr, wg_ptr,
                wu_ptr, wd_ptr, final_norm_ptr, lm_head_ptr, bqkv_ptr, qk_norm_ptr, x_ptr, q_ptr, kc_ptr, vc_ptr,
                opart_ptr, lse_ptr, attn_ptr, act_ptr, logits_ptr, cos_ptr, sin_ptr, vs_ptr, seq_splits,
                H: tl.constexpr, IS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                S: tl.constexpr, EPS: tl.constexpr, SCALE: tl.constexpr, GP: tl.constexpr, BR_O: tl.constexpr,
                BR_GU: tl.constexpr, BR_D: tl.constexpr, BR_LM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                NS: tl.constexpr, ATTN_MMA: tl.constexpr, NS_ATTN: tl.constexpr, SP: tl.constexpr,
                QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BATCH: tl.constexpr, BB: tl.constexpr,
                VOCAB: tl.constexpr, BKB: tl.constexpr, BATCH_MMA: tl.constexpr, VSK: tl.constexpr,
                BATCH_WF: tl.constexpr):
    """One instruction of a batched schedule. Weight ops serve every sequence (each tile loaded once); attention
    serves sequence a3 (`seq`): its q, its cache slot (layer * BATCH + seq of the [L, B, nKV, S, hd] caches), its
    position rt[BATCH + seq], its split partials at seq * seq_splits rows of the partial buffers (the schedule's
    largest split count, where the catalogue's footprints place them, whatever the layer's own count). vs_ptr is
    this program's scratch for the staged operand of the weight ops (ops.stage_batch)."""
    QS: tl.constexpr = NH * HD
    KVS: tl.constexpr = NKV * HD
    G: tl.constexpr = NH // NKV
    if op == OP_EMBED:
        ops.op_embed_batch(embed_ptr, x_ptr, rt_ptr, a0, a1, H, BE, BATCH)
    elif op == OP_QKV:
        ops.op_qkv_rope_batch(x_ptr, attn_norm_ptr, wqkv_ptr, bqkv_ptr, qk_norm_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr,
                              sin_ptr, rt_ptr, vs_ptr, layer, a0, a1, H, NKV, HD, QS, KVS, S, EPS, BKB, NS, QKV_BIAS,
                              QK_NORM, BATCH, BB, BATCH_MMA, VSK, BATCH_WF)
    elif op == OP_PARTIAL:
        pos = tl.load(rt_ptr + BATCH + a3)
        qb = q_ptr + a3 * QS
        ob = opart_ptr + a3 * seq_splits * QS
        lb = lse_ptr + a3 * seq_splits * NH
        if ATTN_MMA:
            ops.op_attn_partial_mma(qb, kc_ptr, vc_ptr, ob, lb, layer * BATCH + a3, a0, a1, a2, pos, NH, NKV, HD, S,
                                    G, BT, SCALE, NS_ATTN)
        else:
            ops.op_attn_partial(qb, kc_ptr, vc_ptr, ob, lb, layer * BATCH + a3, a0, a1, a2, pos, NH, NKV, HD, S, G,
                                GP, BT, SCALE)
    elif op == OP_REDUCE:
        ops.op_attn_reduce(opart_ptr + a3 * seq_splits * QS, lse_ptr + a3 * seq_splits * NH, attn_ptr + a3 * QS, a0,
                           a1, a2, NH, HD, GP, SP)
    elif op == OP_OPROJ:
        ops.op_matvec_residual_batch(wo_ptr, attn_ptr, x_ptr, vs_ptr, layer, a0, a1, a2, a3, H, QS, BR_O, BKB, NS,
                                     BATCH, BB, BATCH_MMA, VSK, BATCH_WF)
    elif op == OP_GATE_UP:
        ops.op_gate_up_batch(x_ptr, mlp_norm_ptr, wg_ptr, wu_ptr, act_ptr, vs_ptr, layer, a0, a1, H, IS, EPS, BR_GU,
                             BKB, NS, BATCH, BB, BATCH_MMA, VSK, BATCH_WF)
    elif op == OP_DOWN:
        ops.op_matvec_residual_batch(wd_ptr, act_ptr, x_ptr, vs_ptr, layer, a0, a1, a2, a3, H, IS, BR_D, BKB, NS,
                                     BATCH, BB, BATCH_MMA, VSK, BATCH_WF)
    elif op == OP_LM_HEAD:
        ops.op_lm_head_batch(x_ptr, final_norm_ptr, lm_head_ptr, logits_ptr, vs_ptr, a0, a1, H, VOCAB, EPS, BR_LM,
                             BKB, NS, BATCH, BB, BATCH_MMA, VSK, BATCH_WF)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time tile shapes and pipelining of interpreter v9 (none of them depend on the schedule)."""

    num_warps: int = 8
    num_stages: int = 4  # software-pipelining depth of the weight-streaming K loops
    bk_qkv: int = 256
    br_o: int = 16
    bk_o: int = 512
    br_gu: int = 32  # 2 x [32, 256] bf16 tiles per stage (measured: better than 16 x 512)
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
    reduce_splits: int = 16  # attention splits attn_reduce folds with all loads issued at once
    warm_o: bool = False  # L2 warm-up of a worker's o_proj tile at the start of its layer
    warm_gu: int = 0  # rows of a worker's gate/up tile warmed into L2 at the start of its layer (0: none)
    batch_mma: bool = True  # a batch's weight products on the tensor cores (hi/lo bf16 split of the vectors)
    batch_tile: int = 4096  # a batch build's weight tile, rows x K elements (16 rows stream K blocks of 256)
    batch_stages: int = 4  # software-pipelining depth of a batch build's weight loops
    batch_rows: int = 0  # a batch build's row tile of every weight op (0: br_o .. br_lm; 64 pays on wide tiles)
    maxnreg: int = 0  # registers per thread ptxas may use (0: its own; it caps llama-1b's batch 2-7 builds at 128)
    batch_weight_first: bool = False  # a batch's weight tile as the product's first operand (ops._staged_mma)


def kernel_constexprs(c: ModelConfig, max_seq_len: int, k: KernelConfig, trace: bool,
                      batch: int = 1) -> dict[str, Any]:
    """The compile-time parameters of interpreter v9 for one model config (launch options included). The QKV K tile
    shrinks for wide heads so its two [hd/2, BK] accumulators stay at 16k fp32 (no spills at head_dim 128). A batch
    is a compile-time constant: each batch size is its own build (the batch-1 build is the code without it); its
    weight tiles hold `batch_tile` elements (rows x K) and meet the sequences' vectors, staged per instruction into
    2 BB rows of VSK elements of scratch per program (`staging_row`), on the tensor cores (`batch_mma`): hi and lo
    rows of at least 8 sequences, so a product is at least 16 wide."""
    hp = _pow2(c.hidden_size)
    bb = batch_lanes(k, batch)
    rows = {}
    if batch > 1 and k.batch_rows:  # a batch build's row tile of every weight op
        rows = dict(BR_O=k.batch_rows, BR_GU=k.batch_rows, BR_D=k.batch_rows, BR_LM=k.batch_rows)
    return dict(
        H=c.hidden_size, IS=c.intermediate_size, NH=c.num_attention_heads, NKV=c.num_key_value_heads, HD=c.hd,
        S=max_seq_len, EPS=float(c.rms_norm_eps), SCALE=1.0 / math.sqrt(c.hd), BLOCK_H=hp,
        GP=max(2, _pow2(c.group_size)), BK_QKV=min(k.bk_qkv, hp, max(32, 8192 // max(1, c.hd // 2))),
        BR_O=k.br_o, BK_O=min(k.bk_o, _pow2(c.q_size)),
        BR_GU=k.br_gu, BK_GU=min(k.bk_gu, hp), BR_D=k.br_d, BK_D=min(k.bk_d, _pow2(c.intermediate_size)),
        BR_LM=k.br_lm, BK_LM=min(k.bk_lm, hp), BT=k.bt, BE=min(k.be, hp), NS=k.num_stages, TRACE=trace,
        ROWW=ROW, PREFETCH=k.prefetch, ATTN_MMA=k.attn_mma, NS_ATTN=k.ns_attn, PF_CAP=k.pf_cap, WB=16, FLAT=k.flat,
        BR_GU2=k.br_gu2, BK_GU2=min(k.bk_gu2, hp), SP=max(1, k.reduce_splits), WARM_O=k.warm_o,
        WARM_GU=k.warm_gu, QKV_BIAS=c.qkv_bias, QK_NORM=c.qk_norm, BATCH=batch, BB=bb, VOCAB=c.vocab_size,
        BKB=k.batch_tile, BATCH_MMA=k.batch_mma, NSB=k.batch_stages, VSK=staging_row(c, k),
        BATCH_WF=k.batch_weight_first,
        num_warps=k.num_warps, num_stages=1) | rows | ({"maxnreg": k.maxnreg} if k.maxnreg else {})


def batch_lanes(k: KernelConfig, batch: int) -> int:
    """BB, the sequences a batch build computes for: the batch rounded up to a power of two, at least 8 on the
    tensor cores (hi and lo rows of 8 sequences make the 16 a product needs)."""
    return max(8, _pow2(batch)) if k.batch_mma else _pow2(batch)


def staging_row(c: ModelConfig, k: KernelConfig) -> int:
    """Elements of one row of a batch build's staged operand (ops.stage_batch): the longest K range of a weight op,
    rounded up to its K block."""
    return max(c.hidden_size, c.intermediate_size, c.q_size) + k.batch_tile


def staging_elements(c: ModelConfig, k: KernelConfig, batch: int) -> int:
    """bf16 elements of one program's scratch for a batch build's staged operand: hi and lo rows of every (padded)
    sequence; 0 without a batch or without `batch_mma`."""
    if batch <= 1 or not k.batch_mma:
        return 0
    return 2 * batch_lanes(k, batch) * staging_row(c, k)
