"""The catalogue's ops as Triton device functions, inlined into interpreter v9 (kernels/gpu/v9.py).

Each function computes exactly what `megasynth.ir.catalogue`'s `compute` of the same op computes (fp32 activations,
bf16 weights and KV cache, fp32 accumulation). Data written by other SMs during the kernel (activations, this step's
K/V) is read with `cache_modifier=".cg"` (L2, never a stale L1 line). Residual reduces into `x` are fp32 atomics.

Matrix-vector products stream weights in [BR, BK] tiles with unmasked, 16-byte-aligned loads along K (the fast path,
taken when the K range starts on a multiple of 16 elements) and a software-pipelined K loop (`tl.range(num_stages)`);
a fully masked path keeps any other K split correct.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megasynth.kernels.gpu import ptx


@triton.jit
def report_stuck(err_ptr, pid, iid, counter, cur, need):
    """Record a watchdog timeout: (flag, worker, instruction id, counter, current, needed, SM) in the error buffer."""
    e = err_ptr + pid * 8
    tl.store(e + 1, pid)
    tl.store(e + 2, iid)
    tl.store(e + 3, counter)
    tl.store(e + 4, cur)
    tl.store(e + 5, need)
    tl.store(e + 6, ptx.smid())
    tl.store(e, 1)


@triton.jit
def rms_rstd(x_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr, EPS: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the residual stream (read from L2)."""
    offs = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + offs, mask=offs < H, other=0.0, cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + EPS)


@triton.jit
def _vec(v_ptr, nw_ptr, kk, kmask, NORM: tl.constexpr, MASKED: tl.constexpr):
    """The vector chunk v[kk] (times the norm weight when NORM), and its sum of squares (for the RMS norm)."""
    if MASKED:
        v = tl.load(v_ptr + kk, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        v = tl.load(v_ptr + kk, cache_modifier=".cg")
    ss = tl.sum(v * v, 0)
    if NORM:
        if MASKED:
            v = v * tl.load(nw_ptr + kk, mask=kmask, other=0.0)
        else:
            v = v * tl.load(nw_ptr + kk)
    return v, ss


@triton.jit
def dot_rows(w_ptr, ld, rows, rmask, k0, k1, v_ptr, nw_ptr,
             NORM: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
             NS: tl.constexpr):
    """sum_k W[rows, k] * v[k] over k in [k0, k1), fp32 [BR]. With NORM (k range = all of x): v = rmsnorm(x) * nw,
    the norm's sum of squares gathered in the same pass (rstd applied once at the end: no separate pass over x)."""
    acc = tl.zeros((BR, BK), tl.float32)
    ss = tl.sum(tl.zeros((BK,), tl.float32), 0)
    ks = tl.arange(0, BK)
    wrow = w_ptr + rows[:, None].to(tl.int64) * ld
    if k0 % 16 == 0:
        k0a = tl.multiple_of(k0, 16)
        nfull = (k1 - k0a) // BK
        kend = k0a + nfull * BK
        for kb in tl.range(0, nfull, num_stages=NS):
            kk = tl.multiple_of(k0a + kb * BK, 16) + ks
            v, sq = _vec(v_ptr, nw_ptr, kk, kk < k1, NORM, False)
            ss += sq
            w = tl.load(wrow + kk[None, :], mask=rmask[:, None], other=0.0)
            acc += w.to(tl.float32) * v[None, :]
        if kend < k1:
            kk = kend + ks
            kmask = kk < k1
            v, sq = _vec(v_ptr, nw_ptr, kk, kmask, NORM, True)
            ss += sq
            w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * v[None, :]
    else:
        for k in tl.range(k0, k1, BK):
            kk = k + ks
            kmask = kk < k1
            v, sq = _vec(v_ptr, nw_ptr, kk, kmask, NORM, True)
            ss += sq
            w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * v[None, :]
    y = tl.sum(acc, 1)
    if NORM:
        y = y * (1.0 / tl.sqrt(ss / H + EPS))
    return y


@triton.jit
def dot_rows2(w1_ptr, w2_ptr, ld, rows1, rows2, rmask, v_ptr, nw_ptr, K: tl.constexpr, EPS: tl.constexpr,
              BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """Two row sets against rmsnorm(v) * nw in one K loop (gate/up, or the two RoPE halves of a head); the norm's
    sum of squares is gathered in the same pass and applied at the end."""
    acc1 = tl.zeros((BR, BK), tl.float32)
    acc2 = tl.zeros((BR, BK), tl.float32)
    ss = tl.sum(tl.zeros((BK,), tl.float32), 0)
    ks = tl.arange(0, BK)
    w1row = w1_ptr + rows1[:, None].to(tl.int64) * ld
    w2row = w2_ptr + rows2[:, None].to(tl.int64) * ld
    if K % BK == 0:
        for k in tl.range(0, K, BK, num_stages=NS):
            kk = k + ks
            x = tl.load(v_ptr + kk, cache_modifier=".cg")
            ss += tl.sum(x * x, 0)
            v = x * tl.load(nw_ptr + kk)
            w1 = tl.load(w1row + kk[None, :], mask=rmask[:, None], other=0.0)
            w2 = tl.load(w2row + kk[None, :], mask=rmask[:, None], other=0.0)
            acc1 += w1.to(tl.float32) * v[None, :]
            acc2 += w2.to(tl.float32) * v[None, :]
    else:
        for k in tl.range(0, K, BK, num_stages=NS):
            kk = k + ks
            kmask = kk < K
            x = tl.load(v_ptr + kk, mask=kmask, other=0.0, cache_modifier=".cg")
            ss += tl.sum(x * x, 0)
            v = x * tl.load(nw_ptr + kk, mask=kmask, other=0.0)
            m = rmask[:, None] & kmask[None, :]
            w1 = tl.load(w1row + kk[None, :], mask=m, other=0.0)
            w2 = tl.load(w2row + kk[None, :], mask=m, other=0.0)
            acc1 += w1.to(tl.float32) * v[None, :]
            acc2 += w2.to(tl.float32) * v[None, :]
    rstd = 1.0 / tl.sqrt(ss / K + EPS)
    return tl.sum(acc1, 1) * rstd, tl.sum(acc2, 1) * rstd


@triton.jit
def op_embed(embed_ptr, x_ptr, token, start, end, H: tl.constexpr, BE: tl.constexpr):
    """x[start:end] = embed[token, start:end]."""
    offs0 = tl.arange(0, BE)
    for e in range(start, end, BE):
        offs = e + offs0
        m = offs < end
        v = tl.load(embed_ptr + token.to(tl.int64) * H + offs, mask=m, other=0.0)
        tl.store(x_ptr + offs, v.to(tl.float32), mask=m)


@triton.jit
def op_qkv_rope(x_ptr, norm_ptr, wqkv_ptr, b_ptr, qkn_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, layer, start, end,
                pos, H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, QS: tl.constexpr, KVS: tl.constexpr,
                S: tl.constexpr, BLOCK_H: tl.constexpr, EPS: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr,
                QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows [start, end) of wqkv @ rmsnorm(x), one head at a time; RoPE (HF halves) on q and k; k/v into the cache.
    With QKV_BIAS (Qwen2) `b_ptr` [L, q+2kv] is added to the rows; with QK_NORM (Qwen3) each q and k head is
    RMS-normalised before RoPE with `qkn_ptr` [L, 2 hd] (q_norm then k_norm): a whole head is in registers here."""
    HALF: tl.constexpr = HD // 2
    QKV: tl.constexpr = QS + 2 * KVS
    nw = norm_ptr + layer * H
    wl = wqkv_ptr + layer.to(tl.int64) * QKV * H
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + j)
    sin = tl.load(sin_ptr + pos * HALF + j)
    rtrue = j < HALF
    for r in range(start, end, HD):
        y1, y2 = dot_rows2(wl, wl, H, r + j, r + HALF + j, rtrue, x_ptr, nw, H, EPS, HALF, BK, NS)
        if QKV_BIAS:
            y1 += tl.load(b_ptr + layer * QKV + r + j)
            y2 += tl.load(b_ptr + layer * QKV + r + HALF + j)
        if r < QS + KVS:
            if QK_NORM:
                inv = 1.0 / tl.sqrt((tl.sum(y1 * y1, 0) + tl.sum(y2 * y2, 0)) / HD + EPS)
                nrm = qkn_ptr + layer * (2 * HD) + tl.where(r < QS, 0, HD)  # q_norm, then k_norm
                y1 = y1 * inv * tl.load(nrm + j)
                y2 = y2 * inv * tl.load(nrm + HALF + j)
            o1 = y1 * cos - y2 * sin
            o2 = y2 * cos + y1 * sin
            if r < QS:
                tl.store(q_ptr + r + j, o1)
                tl.store(q_ptr + r + HALF + j, o2)
            else:
                g = (r - QS) // HD
                base = ((layer * NKV + g).to(tl.int64) * S + pos) * HD
                tl.store(kc_ptr + base + j, o1.to(tl.bfloat16))
                tl.store(kc_ptr + base + HALF + j, o2.to(tl.bfloat16))
        else:
            g = (r - QS - KVS) // HD
            base = ((layer * NKV + g).to(tl.int64) * S + pos) * HD
            tl.store(vc_ptr + base + j, y1.to(tl.bfloat16))
            tl.store(vc_ptr + base + HALF + j, y2.to(tl.bfloat16))


@triton.jit
def _store_split(opart_ptr, lse_ptr, acc, m_i, l_i, empty, row, gm, d, HD: tl.constexpr):
    """An attention split's epilogue: the normalised output and its log-sum-exp (an empty split: 0 and -inf)."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = tl.where(empty, 0.0, acc / safe_l[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(safe_l))
    tl.store(opart_ptr + row[:, None] * HD + d[None, :], o, mask=gm[:, None])
    tl.store(lse_ptr + row, lse, mask=gm)


@triton.jit
def op_attn_partial(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, layer, g, split, splits, pos,
                    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                    GP: tl.constexpr, BT: tl.constexpr, SCALE: tl.constexpr):
    """Attention of KV head g's query heads over positions [split*T//splits, (split+1)*T//splits), T = pos + 1."""
    T = pos + 1
    lo = split * T // splits
    hi = (split + 1) * T // splits
    gi = tl.arange(0, GP)
    gm = gi < G
    d = tl.arange(0, HD)
    h0 = g * G
    q = tl.load(q_ptr + (h0 + gi)[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
    q = q * SCALE
    base = (layer * NKV + g).to(tl.int64) * S * HD
    m_i = tl.full((GP,), -1.0e30, tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, HD), tl.float32)
    tb = tl.arange(0, BT)
    for t0 in range(lo, hi, BT):
        ts = t0 + tb
        tm = ts < hi
        offs = base + ts[:, None] * HD + d[None, :]
        k = tl.load(kc_ptr + offs, mask=tm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        v = tl.load(vc_ptr + offs, mask=tm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [GP, BT]
        s = tl.where(tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    _store_split(opart_ptr, lse_ptr, acc, m_i, l_i, hi <= lo, split * NH + h0 + gi, gm, d, HD)


@triton.jit
def _combine(m, den, acc, lse_ptr, opart_ptr, s, hs, ok, d, NH: tl.constexpr, HD: tl.constexpr):
    """Fold split s (heads hs, lanes ok) into the running (max, denominator, weighted sum) of attn_reduce."""
    ls = tl.load(lse_ptr + s * NH + hs, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(opart_ptr + (s * NH + hs)[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0,
                cache_modifier=".cg")
    m_new = tl.maximum(m, ls)
    alpha = tl.exp(m - m_new)
    wgt = tl.exp(ls - m_new)  # an empty split (lse = -inf) weighs 0
    return m_new, den * alpha + wgt, acc * alpha[:, None] + wgt[:, None] * o


@triton.jit
def op_attn_reduce(opart_ptr, lse_ptr, attn_ptr, start, end, splits, NH: tl.constexpr, HD: tl.constexpr,
                   HB: tl.constexpr, SP: tl.constexpr):
    """attn[heads] = sum_s exp(lse_s - logsumexp(lse)) * o_s over the splits, query heads [start, end).

    The op is pure latency (a few KB from L2), so the first SP splits are an unrolled, masked sequence whose loads
    are all independent (one L2 round trip, not two per split), folded with an online log-sum-exp; any further
    splits follow in a loop."""
    d = tl.arange(0, HD)
    for hc in range(start, end, HB):
        hs = hc + tl.arange(0, HB)
        hm = hs < end
        m = tl.full((HB,), -1.0e30, tl.float32)
        den = tl.zeros((HB,), tl.float32)
        acc = tl.zeros((HB, HD), tl.float32)
        for s in tl.static_range(SP):
            m, den, acc = _combine(m, den, acc, lse_ptr, opart_ptr, s, hs, hm & (s < splits), d, NH, HD)
        for s in range(SP, splits):
            m, den, acc = _combine(m, den, acc, lse_ptr, opart_ptr, s, hs, hm, d, NH, HD)
        den = tl.where(den > 0, den, 1.0)
        tl.store(attn_ptr + hs[:, None] * HD + d[None, :], acc / den[:, None], mask=hm[:, None])


@triton.jit
def op_matvec_residual(w_ptr, v_ptr, x_ptr, layer, start, end, k0, k1, R: tl.constexpr, K: tl.constexpr,
                       BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """x[start:end] += W[layer][start:end, k0:k1] @ v[k0:k1] (W is [L, R, K]); fp32 atomics (K-split safe)."""
    wl = w_ptr + layer.to(tl.int64) * R * K
    rb = tl.arange(0, BR)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        y = dot_rows(wl, K, rows, rmask, k0, k1, v_ptr, v_ptr, False, K, 1.0, BR, BK, NS)
        tl.atomic_add(x_ptr + rows, y, mask=rmask, sem="relaxed", scope="gpu")


@triton.jit
def op_gate_up(x_ptr, norm_ptr, wg_ptr, wu_ptr, act_ptr, layer, start, end, H: tl.constexpr, IS: tl.constexpr,
               BLOCK_H: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """act[start:end] = silu(w_gate @ h) * (w_up @ h), h = rmsnorm(x) * mlp_norm."""
    nw = norm_ptr + layer * H
    off = layer.to(tl.int64) * IS * H
    rb = tl.arange(0, BR)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        g, u = dot_rows2(wg_ptr + off, wu_ptr + off, H, rows, rows, rmask, x_ptr, nw, H, EPS, BR, BK, NS)
        tl.store(act_ptr + rows, g / (1.0 + tl.exp(-g)) * u, mask=rmask)


@triton.jit
def op_lm_head(x_ptr, norm_ptr, w_ptr, logits_ptr, start, end, H: tl.constexpr, BLOCK_H: tl.constexpr,
               EPS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """logits[start:end] = lm_head[start:end] @ (rmsnorm(x) * final_norm)."""
    rb = tl.arange(0, BR)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        y = dot_rows(w_ptr, H, rows, rmask, start * 0, start * 0 + H, x_ptr, norm_ptr, True, H, EPS, BR, BK, NS)
        tl.store(logits_ptr + rows, y, mask=rmask)


@triton.jit
def _split_bf16(x):
    """x (fp32) = hi + lo with both bf16: two tensor-core products give ~16 mantissa bits instead of 8."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def op_attn_partial_mma(q_ptr, kc_ptr, vc_ptr, opart_ptr, lse_ptr, layer, g, split, splits, pos,
                        NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                        BT: tl.constexpr, SCALE: tl.constexpr, NS: tl.constexpr):
    """`op_attn_partial` on the tensor cores (flash-decoding): the group's query heads padded to 16 rows, q and p
    split into bf16 hi + lo parts so the products keep fp32-level accuracy; the K/V stream is software-pipelined."""
    MQ: tl.constexpr = 16
    T = pos + 1
    lo = split * T // splits
    hi = (split + 1) * T // splits
    gi = tl.arange(0, MQ)
    gm = gi < G
    d = tl.arange(0, HD)
    h0 = g * G
    q = tl.load(q_ptr + (h0 + gi)[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
    q_hi, q_lo = _split_bf16(q * SCALE)
    base = (layer * NKV + g).to(tl.int64) * S * HD
    m_i = tl.full((MQ,), -1.0e30, tl.float32)
    l_i = tl.zeros((MQ,), tl.float32)
    acc = tl.zeros((MQ, HD), tl.float32)
    tb = tl.arange(0, BT)
    for t0 in tl.range(lo, hi, BT, num_stages=NS):
        ts = t0 + tb
        tm = ts < hi
        offs = base + ts[:, None] * HD + d[None, :]
        k = tl.load(kc_ptr + offs, mask=tm[:, None], other=0.0, cache_modifier=".cg")
        v = tl.load(vc_ptr + offs, mask=tm[:, None], other=0.0, cache_modifier=".cg")
        kt = tl.trans(k)
        s = tl.dot(q_hi, kt) + tl.dot(q_lo, kt)  # [MQ, BT] fp32
        s = tl.where(tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_hi, p_lo = _split_bf16(p)
        acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
        m_i = m_new
    _store_split(opart_ptr, lse_ptr, acc, m_i, l_i, hi <= lo, split * NH + h0 + gi, gm, d, HD)


@triton.jit
def prefetch_range(base_ptr, off_bytes, nbytes, CH: tl.constexpr, NCH: tl.constexpr):
    """Ask the copy engine to stream bytes [off, off + nbytes) of an allocation into L2 (cp.async.bulk.prefetch:
    no registers, no wait). Weights never depend on a counter, so this is issued before an instruction's waits and
    HBM works while the SM spins. The range is rounded out to 16 bytes; prefetches are hints and never fault."""
    if nbytes > 0:
        addr = base_ptr.to(tl.pointer_type(tl.int8))
        mis = off_bytes % 16
        start = off_bytes - mis
        total = (nbytes + mis).to(tl.int32)
        offs = tl.arange(0, NCH) * CH
        for b in range(0, total, CH * NCH):
            o = b + offs
            size = tl.minimum(total - o, CH)
            size = (size + 15) // 16 * 16
            ptx.prefetch_l2(addr + start + o, size)


@triton.jit
def prefetch_rows(w_ptr, woff, ld, r0, r1, k0, k1, CAP: tl.constexpr):
    """Prefetch the first CAP bytes of W[r0:r1, k0:k1] (bf16, row stride ld, starting woff elements into w_ptr): one
    region when the K range is whole rows, else one per row."""
    if (k0 == 0) & (k1 == ld):
        prefetch_range(w_ptr, (woff + r0.to(tl.int64) * ld) * 2, tl.minimum((r1 - r0) * ld * 2, CAP), 1024, 256)
    else:
        r_end = tl.minimum(r1, r0 + tl.maximum(CAP // tl.maximum((k1 - k0) * 2, 1), 1))
        for r in range(r0, r_end):
            prefetch_range(w_ptr, (woff + r * ld + k0) * 2, (k1 - k0) * 2, 1024, 256)


@triton.jit
def prefetch_instruction(op, layer, a0, a1, a2, a3, pos, wqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, lm_head_ptr,
                         kc_ptr, vc_ptr, H: tl.constexpr, IS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
                         HD: tl.constexpr, S: tl.constexpr, OP_QKV: tl.constexpr, OP_PARTIAL: tl.constexpr,
                         OP_OPROJ: tl.constexpr, OP_GATE_UP: tl.constexpr, OP_DOWN: tl.constexpr,
                         OP_LM_HEAD: tl.constexpr, CAP: tl.constexpr):
    """L2 prefetch of the weights (or the KV history) one instruction will stream."""
    QS: tl.constexpr = NH * HD
    QKV: tl.constexpr = QS + 2 * NKV * HD
    zero = a0 * 0
    if op == OP_QKV:
        prefetch_rows(wqkv_ptr, layer.to(tl.int64) * QKV * H, H, a0, a1, zero, zero + H, CAP)
    elif op == OP_OPROJ:
        prefetch_rows(wo_ptr, layer.to(tl.int64) * H * QS, QS, a0, a1, a2, a3, CAP)
    elif op == OP_GATE_UP:
        off = layer.to(tl.int64) * IS * H
        prefetch_rows(wg_ptr, off, H, a0, a1, zero, zero + H, CAP // 2)
        prefetch_rows(wu_ptr, off, H, a0, a1, zero, zero + H, CAP // 2)
    elif op == OP_DOWN:
        prefetch_rows(wd_ptr, layer.to(tl.int64) * H * IS, IS, a0, a1, a2, a3, CAP)
    elif op == OP_LM_HEAD:
        prefetch_rows(lm_head_ptr, zero.to(tl.int64), H, a0, a1, zero, zero + H, CAP)
    elif op == OP_PARTIAL:
        T = pos + 1
        lo = a1 * T // a2
        hi = (a1 + 1) * T // a2
        base = ((layer * NKV + a0).to(tl.int64) * S + lo) * HD * 2
        prefetch_range(kc_ptr, base, tl.minimum((hi - lo) * HD * 2, CAP // 2), 1024, 256)
        prefetch_range(vc_ptr, base, tl.minimum((hi - lo) * HD * 2, CAP // 2), 1024, 256)


@triton.jit
def op_gate_up_flat(x_ptr, norm_ptr, wg_ptr, wu_ptr, act_ptr, layer, start, end, H: tl.constexpr,
                    IS: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """`op_gate_up` as ONE software-pipelined loop over (row block, K block) pairs: the weight stream of the whole
    instruction flows without a pipeline drain and refill at each row block. Needs H % BK == 0."""
    NKB: tl.constexpr = H // BK
    nw = norm_ptr + layer * H
    off = layer.to(tl.int64) * IS * H
    nrb = (end - start + BR - 1) // BR
    rb = tl.arange(0, BR)
    ks = tl.arange(0, BK)
    acc1 = tl.zeros((BR, BK), tl.float32)
    acc2 = tl.zeros((BR, BK), tl.float32)
    ss = tl.sum(tl.zeros((BK,), tl.float32), 0)
    for it in tl.range(0, nrb * NKB, num_stages=NS):
        kb = it % NKB
        rows = start + (it // NKB) * BR + rb
        rmask = rows < end
        kk = kb * BK + ks
        x = tl.load(x_ptr + kk, cache_modifier=".cg")
        v = x * tl.load(nw + kk)
        wrow = rows[:, None].to(tl.int64) * H + kk[None, :]
        w1 = tl.load(wg_ptr + off + wrow, mask=rmask[:, None], other=0.0)
        w2 = tl.load(wu_ptr + off + wrow, mask=rmask[:, None], other=0.0)
        keep = (kb != 0).to(tl.float32)  # a new row block starts from zero
        acc1 = acc1 * keep + w1.to(tl.float32) * v[None, :]
        acc2 = acc2 * keep + w2.to(tl.float32) * v[None, :]
        ss = ss * keep + tl.sum(x * x, 0)
        if kb == NKB - 1:
            rstd = 1.0 / tl.sqrt(ss / H + EPS)
            g = tl.sum(acc1, 1) * rstd
            u = tl.sum(acc2, 1) * rstd
            tl.store(act_ptr + rows, g / (1.0 + tl.exp(-g)) * u, mask=rmask)


@triton.jit
def op_lm_head_flat(x_ptr, norm_ptr, w_ptr, logits_ptr, start, end, H: tl.constexpr, EPS: tl.constexpr,
                    BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    """`op_lm_head` as one pipelined loop over (row block, K block) pairs. Needs H % BK == 0."""
    NKB: tl.constexpr = H // BK
    nrb = (end - start + BR - 1) // BR
    rb = tl.arange(0, BR)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BR, BK), tl.float32)
    ss = tl.sum(tl.zeros((BK,), tl.float32), 0)
    for it in tl.range(0, nrb * NKB, num_stages=NS):
        kb = it % NKB
        rows = start + (it // NKB) * BR + rb
        rmask = rows < end
        kk = kb * BK + ks
        x = tl.load(x_ptr + kk, cache_modifier=".cg")
        v = x * tl.load(norm_ptr + kk)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * H + kk[None, :], mask=rmask[:, None], other=0.0)
        keep = (kb != 0).to(tl.float32)
        acc = acc * keep + w.to(tl.float32) * v[None, :]
        ss = ss * keep + tl.sum(x * x, 0)
        if kb == NKB - 1:
            y = tl.sum(acc, 1) * (1.0 / tl.sqrt(ss / H + EPS))
            tl.store(logits_ptr + rows, y, mask=rmask)


# -- a batch of sequences (interpreter v9 with BATCH > 1) ------------------------------------------------------------
# Sequence b's part of an activation buffer starts at b times one sequence's size; its KV cache slot of layer l is
# slot l * BATCH + b of the [L, B, nKV, S, hd] caches; its token and position are rt[b] and rt[BATCH + b]. Every
# weight tile is loaded once per instruction and multiplied by every sequence's vector on the tensor cores. The
# vectors are staged once per instruction (`stage_batch`) into the program's own scratch in global memory (L2-hot,
# private to the program): a [2 BB, K] bf16 operand whose row b is sequence b's vector (normalised when the op
# norms) rounded to bf16 and row BB + b the rounding's remainder (hi + lo: ~16 mantissa bits, as the fp32 batch-1
# path's products), BB = BATCH rounded up to a power of two of at least 8, padding rows zero. The K loop is then a
# plain pipelined tensor-core product (`dot_staged`, the weight tile as its second operand so that the tile's rows
# spread over the warps): weight tile and operand block both go straight from global to shared memory, with no
# arithmetic on the operand inside the loop. BKB is the weight elements one K step loads (rows x K). Staging costs
# K x batch values per instruction against its K x rows weights, so a batch wants instructions of many rows
# (docs/perf-notes.md). Without `batch_mma`, and for tiles of fewer than 16 rows (tiny heads), the fp32 CUDA-core
# broadcast product runs instead, the K block sized to keep [rows, batch, block] at 8k values.


@triton.jit
def _rstd_batch(v_ptr, vstride, bs, bm, H: tl.constexpr, EPS: tl.constexpr):
    """Every sequence's 1 / rms(v_b) over its H elements, [BB]: one pass before a K loop, so that the loop itself
    holds no cross-warp reduction."""
    CH: tl.constexpr = 256
    ks = tl.arange(0, CH)
    acc = tl.zeros((bs.shape[0], CH), tl.float32)
    for k in range(0, H, CH):
        kk = k + ks
        v = tl.load(v_ptr + bs[:, None] * vstride + kk[None, :], mask=bm[:, None] & (kk < H)[None, :], other=0.0,
                    cache_modifier=".cg")
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, 1) / H + EPS)


@triton.jit
def _vec_batch(v_ptr, vstride, nw_ptr, rstd, kk, kmask, bs, bm, NORM: tl.constexpr):
    """Every sequence's chunk v_b[kk] as [BB, BK], normalised (times its rstd and the norm weight) when NORM."""
    v = tl.load(v_ptr + bs[:, None] * vstride + kk[None, :], mask=bm[:, None] & kmask[None, :], other=0.0,
                cache_modifier=".cg")
    if NORM:
        v = v * rstd[:, None] * tl.load(nw_ptr + kk, mask=kmask, other=0.0)[None, :]
    return v


@triton.jit
def stage_batch(vs_ptr, v_ptr, vstride, nw_ptr, k0, k1, NORM: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr,
                BATCH: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr):
    """Row b of vs (KS elements per row) = the bf16 hi, row BB + b the lo, of sequence b's v_b[k0:k1] (times its rstd
    and the norm weight with NORM); zero past k1 up to the next multiple of BK, and in the padding rows. CTA barriers
    before (the previous instruction's reads of vs are done) and after (every thread's stores are visible)."""
    tl.debug_barrier()
    CH: tl.constexpr = max(16, 4096 // BB)
    bs = tl.arange(0, BB)
    bm = bs < BATCH
    ks = tl.arange(0, CH)
    rstd = _rstd_batch(v_ptr, vstride, bs, bm, H, EPS) if NORM else tl.zeros((BB,), tl.float32)
    n = k1 - k0
    nup = (n + BK - 1) // BK * BK
    for c in range(0, nup, CH):
        kk = c + ks
        km = kk < n
        v = tl.load(v_ptr + bs[:, None] * vstride + (k0 + kk)[None, :], mask=bm[:, None] & km[None, :], other=0.0,
                    cache_modifier=".cg")  # [BB, CH]
        if NORM:
            v = v * rstd[:, None] * tl.load(nw_ptr + k0 + kk, mask=km, other=0.0)[None, :]
        hi, lo = _split_bf16(v)
        dst = vs_ptr + bs[:, None] * KS + kk[None, :]
        sm = (kk < nup)[None, :]
        tl.store(dst, hi, mask=sm)
        tl.store(dst + BB * KS, lo, mask=sm)
    tl.debug_barrier()


@triton.jit
def _staged_mma(acc, w, v, WF: tl.constexpr):
    """acc += the product of a weight block w [BR, BK] and an operand block v [2 BB, BK]: acc [BR, 2 BB] = w v^T with
    WF (the weight first: a warpgroup MMA from shared memory at 64 rows and more), else acc [2 BB, BR] = v w^T."""
    if WF:
        acc = tl.dot(w, tl.trans(v), acc)
    else:
        acc = tl.dot(v, tl.trans(w), acc)
    return acc


@triton.jit
def _staged_loop(acc, wrow, rmask, k0, nfull, vrow, BK: tl.constexpr, NS: tl.constexpr, WF: tl.constexpr):
    """`_staged_mma` of W[rows, k0 + kb BK ...] and vs block kb over the nfull whole K blocks."""
    ks = tl.arange(0, BK)
    for kb in tl.range(0, nfull, num_stages=NS):
        kk = kb * BK + ks
        w = tl.load(wrow + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
        v = tl.load(vrow + kk[None, :], cache_modifier=".cg")
        acc = _staged_mma(acc, w, v, WF)
    return acc


@triton.jit
def dot_staged(w_ptr, ld, rows, rmask, k0, k1, vs_ptr, BR: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr,
               BB: tl.constexpr, KS: tl.constexpr, WF: tl.constexpr):
    """[BR, BB]: column b = W[rows, k0:k1] @ v_b, v_b staged in vs by `stage_batch` for the same [k0, k1). One
    tensor-core product per K block, by default with the weight tile as the second operand, so the tile's rows
    spread over the warps (the staged rows, hi and lo of every sequence, are the product's 2 BB rows); with WF the
    weight tile first (`_staged_mma`). hi and lo summed at the end."""
    N: tl.constexpr = 2 * BB
    if WF:
        acc = tl.zeros((BR, N), tl.float32)
    else:
        acc = tl.zeros((N, BR), tl.float32)
    wrow = w_ptr + rows[:, None].to(tl.int64) * ld
    vrow = vs_ptr + tl.arange(0, N)[:, None] * KS
    n = k1 - k0
    nfull = n // BK
    if k0 % 8 == 0:  # 16-byte aligned weight rows: vector copies
        acc = _staged_loop(acc, wrow, rmask, tl.multiple_of(k0, 8), nfull, vrow, BK, NS, WF)
    else:
        acc = _staged_loop(acc, wrow, rmask, k0, nfull, vrow, BK, NS, WF)
    if nfull * BK < n:  # the last, partial block (the staged operand is zero past k1)
        kk = nfull * BK + tl.arange(0, BK)
        w = tl.load(wrow + (k0 + kk)[None, :], mask=rmask[:, None] & (kk < n)[None, :], other=0.0)
        acc = _staged_mma(acc, w, tl.load(vrow + kk[None, :], cache_modifier=".cg"), WF)
    if WF:
        y = tl.sum(tl.reshape(acc, (BR, 2, BB)), 1)
    else:
        y = tl.trans(tl.sum(tl.reshape(acc, (2, BB, BR)), 0))
    return y


@triton.jit
def dot_rows_batch(w_ptr, ld, rows, rmask, k0, k1, v_ptr, vstride, nw_ptr, NORM: tl.constexpr, H: tl.constexpr,
                   EPS: tl.constexpr, BR: tl.constexpr, NS: tl.constexpr, BATCH: tl.constexpr, BB: tl.constexpr):
    """`dot_rows` for BATCH vectors (sequence b's at v_ptr + b * vstride) on the CUDA cores: fp32 [BR, BB], column b
    = W[rows, k0:k1] @ v_b (times v_b's own rstd with NORM). Each weight tile is loaded once for the whole batch."""
    BK: tl.constexpr = max(16, 8192 // (BR * BB))
    bs = tl.arange(0, BB)
    bm = bs < BATCH
    ks = tl.arange(0, BK)
    acc = tl.zeros((BR, BB), tl.float32)
    rstd = _rstd_batch(v_ptr, vstride, bs, bm, H, EPS) if NORM else tl.zeros((BB,), tl.float32)
    wrow = w_ptr + rows[:, None].to(tl.int64) * ld
    for k in tl.range(k0, k1, BK, num_stages=NS):
        kk = k + ks
        kmask = kk < k1
        v = _vec_batch(v_ptr, vstride, nw_ptr, rstd, kk, kmask, bs, bm, NORM)
        w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32)[:, None, :] * v[None, :, :], 2)
    return acc


@triton.jit
def dot_rows2_batch(w1_ptr, w2_ptr, ld, rows1, rows2, rmask, v_ptr, vstride, nw_ptr, K: tl.constexpr,
                    EPS: tl.constexpr, BR: tl.constexpr, NS: tl.constexpr, BATCH: tl.constexpr, BB: tl.constexpr):
    """`dot_rows2` for BATCH vectors on the CUDA cores: two row sets against each sequence's rmsnorm(v_b) * nw in one
    K loop, fp32 [BR, BB] each (gate/up, or the two RoPE halves of a head)."""
    BK: tl.constexpr = max(16, 8192 // (BR * BB))
    bs = tl.arange(0, BB)
    bm = bs < BATCH
    ks = tl.arange(0, BK)
    acc1 = tl.zeros((BR, BB), tl.float32)
    acc2 = tl.zeros((BR, BB), tl.float32)
    rstd = _rstd_batch(v_ptr, vstride, bs, bm, K, EPS)
    w1row = w1_ptr + rows1[:, None].to(tl.int64) * ld
    w2row = w2_ptr + rows2[:, None].to(tl.int64) * ld
    for k in tl.range(0, K, BK, num_stages=NS):
        kk = k + ks
        kmask = kk < K
        v = _vec_batch(v_ptr, vstride, nw_ptr, rstd, kk, kmask, bs, bm, True)
        m = rmask[:, None] & kmask[None, :]
        w1 = tl.load(w1row + kk[None, :], mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w2row + kk[None, :], mask=m, other=0.0).to(tl.float32)
        acc1 += tl.sum(w1[:, None, :] * v[None, :, :], 2)
        acc2 += tl.sum(w2[:, None, :] * v[None, :, :], 2)
    return acc1, acc2


@triton.jit
def op_embed_batch(embed_ptr, x_ptr, rt_ptr, start, end, H: tl.constexpr, BE: tl.constexpr, BATCH: tl.constexpr):
    """x_b[start:end] = embed[token_b, start:end] for every sequence b."""
    for b in range(BATCH):
        op_embed(embed_ptr, x_ptr + b * H, tl.load(rt_ptr + b), start, end, H, BE)


@triton.jit
def op_qkv_rope_batch(x_ptr, norm_ptr, wqkv_ptr, b_ptr, qkn_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, rt_ptr,
                      vs_ptr, layer, start, end, H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, QS: tl.constexpr,
                      KVS: tl.constexpr, S: tl.constexpr, EPS: tl.constexpr, BKB: tl.constexpr, NS: tl.constexpr,
                      QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BATCH: tl.constexpr, BB: tl.constexpr,
                      MMA: tl.constexpr, KS: tl.constexpr, WF: tl.constexpr):
    """`op_qkv_rope` for every sequence: one stream of the tile's rows, each sequence normalised, biased, normed per
    head and rotated at its own position; its q into q_b, its k/v into its cache slot at its position."""
    HALF: tl.constexpr = HD // 2
    QKV: tl.constexpr = QS + 2 * KVS
    STAGED: tl.constexpr = MMA and HALF >= 16
    BK: tl.constexpr = BKB // HALF
    nw = norm_ptr + layer * H
    wl = wqkv_ptr + layer.to(tl.int64) * QKV * H
    j = tl.arange(0, HALF)
    if STAGED:
        stage_batch(vs_ptr, x_ptr, H, nw, layer * 0, layer * 0 + H, True, H, EPS, BATCH, BB, BK, KS)
    bs = tl.arange(0, BB)
    bm = bs < BATCH
    m2 = (j[:, None] < HALF) & bm[None, :]
    pos = tl.load(rt_ptr + BATCH + bs, mask=bm, other=0)
    cos = tl.load(cos_ptr + pos[None, :] * HALF + j[:, None], mask=m2, other=0.0)  # [HALF, BB]
    sin = tl.load(sin_ptr + pos[None, :] * HALF + j[:, None], mask=m2, other=0.0)
    for r in range(start, end, HD):
        if STAGED:
            y1 = dot_staged(wl, H, r + j, j < HALF, layer * 0, layer * 0 + H, vs_ptr, HALF, BK, NS, BB, KS, WF)
            y2 = dot_staged(wl, H, r + HALF + j, j < HALF, layer * 0, layer * 0 + H, vs_ptr, HALF, BK, NS, BB, KS, WF)
        else:
            y1, y2 = dot_rows2_batch(wl, wl, H, r + j, r + HALF + j, j < HALF, x_ptr, H, nw, H, EPS, HALF, NS, BATCH,
                                     BB)
        if QKV_BIAS:
            y1 += tl.load(b_ptr + layer * QKV + r + j)[:, None]
            y2 += tl.load(b_ptr + layer * QKV + r + HALF + j)[:, None]
        if r < QS + KVS:
            if QK_NORM:
                inv = 1.0 / tl.sqrt((tl.sum(y1 * y1, 0) + tl.sum(y2 * y2, 0)) / HD + EPS)  # [BB]
                nrm = qkn_ptr + layer * (2 * HD) + tl.where(r < QS, 0, HD)
                y1 = y1 * inv[None, :] * tl.load(nrm + j)[:, None]
                y2 = y2 * inv[None, :] * tl.load(nrm + HALF + j)[:, None]
            o1 = y1 * cos - y2 * sin
            o2 = y2 * cos + y1 * sin
            if r < QS:
                qo = q_ptr + bs[None, :] * QS + r + j[:, None]
                tl.store(qo, o1, mask=m2)
                tl.store(qo + HALF, o2, mask=m2)
            else:
                g = (r - QS) // HD
                base = (((layer * BATCH + bs) * NKV + g).to(tl.int64) * S + pos) * HD
                tl.store(kc_ptr + base[None, :] + j[:, None], o1.to(tl.bfloat16), mask=m2)
                tl.store(kc_ptr + base[None, :] + HALF + j[:, None], o2.to(tl.bfloat16), mask=m2)
        else:
            g = (r - QS - KVS) // HD
            base = (((layer * BATCH + bs) * NKV + g).to(tl.int64) * S + pos) * HD
            tl.store(vc_ptr + base[None, :] + j[:, None], y1.to(tl.bfloat16), mask=m2)
            tl.store(vc_ptr + base[None, :] + HALF + j[:, None], y2.to(tl.bfloat16), mask=m2)


@triton.jit
def op_matvec_residual_batch(w_ptr, v_ptr, x_ptr, vs_ptr, layer, start, end, k0, k1, R: tl.constexpr,
                             K: tl.constexpr, BR: tl.constexpr, BKB: tl.constexpr, NS: tl.constexpr,
                             BATCH: tl.constexpr, BB: tl.constexpr, MMA: tl.constexpr, KS: tl.constexpr,
                             WF: tl.constexpr):
    """x_b[start:end] += W[layer][start:end, k0:k1] @ v_b[k0:k1] for every sequence b; fp32 atomics."""
    STAGED: tl.constexpr = MMA and BR >= 16
    BK: tl.constexpr = BKB // BR
    wl = w_ptr + layer.to(tl.int64) * R * K
    rb = tl.arange(0, BR)
    bs = tl.arange(0, BB)
    if STAGED:
        stage_batch(vs_ptr, v_ptr, K, v_ptr, k0, k1, False, K, 1.0, BATCH, BB, BK, KS)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        if STAGED:
            y = dot_staged(wl, K, rows, rmask, k0, k1, vs_ptr, BR, BK, NS, BB, KS, WF)
        else:
            y = dot_rows_batch(wl, K, rows, rmask, k0, k1, v_ptr, K, v_ptr, False, K, 1.0, BR, NS, BATCH, BB)
        tl.atomic_add(x_ptr + bs[None, :] * R + rows[:, None], y, mask=rmask[:, None] & (bs < BATCH)[None, :],
                      sem="relaxed", scope="gpu")


@triton.jit
def op_gate_up_batch(x_ptr, norm_ptr, wg_ptr, wu_ptr, act_ptr, vs_ptr, layer, start, end, H: tl.constexpr,
                     IS: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr, BKB: tl.constexpr, NS: tl.constexpr,
                     BATCH: tl.constexpr, BB: tl.constexpr, MMA: tl.constexpr, KS: tl.constexpr, WF: tl.constexpr):
    """act_b[start:end] = silu(w_gate @ h_b) * (w_up @ h_b), h_b = rmsnorm(x_b) * mlp_norm, for every sequence b."""
    STAGED: tl.constexpr = MMA and BR >= 16
    BK: tl.constexpr = BKB // BR
    nw = norm_ptr + layer * H
    off = layer.to(tl.int64) * IS * H
    rb = tl.arange(0, BR)
    bs = tl.arange(0, BB)
    if STAGED:
        stage_batch(vs_ptr, x_ptr, H, nw, layer * 0, layer * 0 + H, True, H, EPS, BATCH, BB, BK, KS)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        if STAGED:
            g = dot_staged(wg_ptr + off, H, rows, rmask, layer * 0, layer * 0 + H, vs_ptr, BR, BK, NS, BB, KS, WF)
            u = dot_staged(wu_ptr + off, H, rows, rmask, layer * 0, layer * 0 + H, vs_ptr, BR, BK, NS, BB, KS, WF)
        else:
            g, u = dot_rows2_batch(wg_ptr + off, wu_ptr + off, H, rows, rows, rmask, x_ptr, H, nw, H, EPS, BR, NS,
                                   BATCH, BB)
        tl.store(act_ptr + bs[None, :] * IS + rows[:, None], g / (1.0 + tl.exp(-g)) * u,
                 mask=rmask[:, None] & (bs < BATCH)[None, :])


@triton.jit
def op_lm_head_batch(x_ptr, norm_ptr, w_ptr, logits_ptr, vs_ptr, start, end, H: tl.constexpr, V: tl.constexpr,
                     EPS: tl.constexpr, BR: tl.constexpr, BKB: tl.constexpr, NS: tl.constexpr, BATCH: tl.constexpr,
                     BB: tl.constexpr, MMA: tl.constexpr, KS: tl.constexpr, WF: tl.constexpr):
    """logits_b[start:end] = lm_head[start:end] @ (rmsnorm(x_b) * final_norm) for every sequence b."""
    STAGED: tl.constexpr = MMA and BR >= 16
    BK: tl.constexpr = BKB // BR
    rb = tl.arange(0, BR)
    bs = tl.arange(0, BB)
    if STAGED:
        stage_batch(vs_ptr, x_ptr, H, norm_ptr, start * 0, start * 0 + H, True, H, EPS, BATCH, BB, BK, KS)
    for r in range(start, end, BR):
        rows = r + rb
        rmask = rows < end
        if STAGED:
            y = dot_staged(w_ptr, H, rows, rmask, start * 0, start * 0 + H, vs_ptr, BR, BK, NS, BB, KS, WF)
        else:
            y = dot_rows_batch(w_ptr, H, rows, rmask, start * 0, start * 0 + H, x_ptr, H, norm_ptr, True, H, EPS,
                               BR, NS, BATCH, BB)
        tl.store(logits_ptr + bs[None, :] * V + rows[:, None], y, mask=rmask[:, None] & (bs < BATCH)[None, :])
