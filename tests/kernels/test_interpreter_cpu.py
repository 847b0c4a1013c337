"""The persistent Triton interpreter (kernels/gpu/) run on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`).

No GPU needed: one worker walks the whole packed queue (programs run one after another there), so this checks the
kernel's own logic (row decode and look-ahead, waits and signals, opcode dispatch, every op's indexing, K splits, the
attention-split reduce; QK-norm and the QKV bias on the tiny Qwen3 and Qwen2 rows) against the PyTorch reference. Two
limits of Triton's interpreter shape it: `tl.dot` on bf16 multiplies raw bit patterns (so attention and a batch's
weight products run on the fp32 paths, `attn_mma=False, batch_mma=False`; the tensor-core paths are covered by the
GPU tests only), and its bf16 conversion truncates
(errors ~1e-3, tolerance 5e-3). Triton 3.6's interpreter also needs NumPy < 2.4 (it converts one-element arrays to
Python ints). Each case runs in a subprocess, because `TRITON_INTERPRET` must be set before Triton and
`megasynth.kernels.gpu.ptx` are imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)"),
    pytest.mark.skipif(tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
                       reason="Triton's interpreter needs NumPy < 2.4"),
]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
from megasynth.kernels.gpu import KernelConfig, Megakernel
from megasynth.kernels.reference import decode_batch, decode_step
from megasynth.kernels.weights import random_weights
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model, with_batch
from megasynth.lowering.strategy import Strategy

case = json.loads(sys.argv[1])
spec = with_batch(get_model(case["model"]), case.get("batch"))  # a batch: a token and a position per sequence
cfg = spec.config
w = {k: v.to(torch.bfloat16) for k, v in random_weights(cfg, seed=3).items()}
if cfg.tie_word_embeddings:
    w["lm_head"] = w["embed"]
sched = lower(spec, 1, Strategy(**case["strategy"]))
if "set" in case:  # a schedule set: one member per range, picked by position
    from megasynth.ir.schedule_set import ScheduleSet
    members = [lower(spec, 1, Strategy(**st)) for st in case["set"]["strategies"]]
    sched = ScheduleSet(case["set"]["bounds"], members, [str(k) for k in range(len(members))])
mk = Megakernel(sched, w, device="cpu", max_seq_len=spec.max_seq_len,
                config=KernelConfig(attn_mma=False, batch_mma=False, **case["kernel"]))
gen = torch.Generator().manual_seed(5)
mk.k_cache.normal_(generator=gen)
mk.v_cache.normal_(generator=gen)
out = []
for token, pos in case["steps"]:
    kref, vref = mk.k_cache.clone(), mk.v_cache.clone()
    got = mk.step(token, pos)
    if isinstance(pos, list):  # each sequence alone, in its own cache slot; the worst sequence's error
        ref = decode_batch(cfg, w, kref, vref, token, pos)
        rel = max(float((got[b] - ref[b]).norm() / ref[b].norm()) for b in range(len(pos)))
        # and against the batch-1 build on each sequence alone (same data): the batch changes nothing but the
        # order of fp32 sums, while both carry the interpreter's truncating bf16 error against the reference
        one = Megakernel(lower(get_model(case["model"]), 1, Strategy(**case["strategy"])), w, device="cpu",
                         max_seq_len=spec.max_seq_len,
                         config=KernelConfig(attn_mma=False, batch_mma=False, **case["kernel"]))
        vs_one = 0.0
        for b in range(len(pos)):
            one.k_cache.copy_(kref[:, b])
            one.v_cache.copy_(vref[:, b])
            y = one.step(token[b], pos[b])
            vs_one = max(vs_one, float((got[b] - y).norm() / y.norm()))
    else:
        ref = decode_step(cfg, w, kref, vref, token, pos)
        rel = float((got - ref).norm() / ref.norm())
    out.append({"rel": rel, "vs_batch1": vs_one if isinstance(pos, list) else None,
                "kv": float(max((mk.k_cache.float() - kref.float()).abs().max(),
                                (mk.v_cache.float() - vref.float()).abs().max())),
                "counters_ok": mk.counters().tolist() == mk.packed.expected_counters.tolist(),
                "member": next((k for k, m in enumerate(mk.members) if m is mk.packed), None)})
print(json.dumps(out))
"""

CASES = {
    "tiny naive": {"model": "tiny", "strategy": {}, "kernel": {}, "steps": [[7, 0], [11, 1], [3, 30]]},
    "tiny splits3 k-split2, reduce unrolled 2": {
        "model": "tiny", "kernel": {"reduce_splits": 2},
        "strategy": {"attn_splits": 3, "k_splits": {"o_proj_residual": 2, "down_proj_residual": 2},
                     "tiles": {"mlp_norm_gate_up": 64, "final_norm_lm_head": 40}},
        "steps": [[5, 40], [9, 41]]},
    "tiny-gqa4 per-head edges, L2 warm-up hints": {
        "model": "tiny-gqa4", "kernel": {"warm_o": True, "warm_gu": 16, "num_stages": 3},
        "strategy": {"attn_splits": 2, "edges": {"attn_norm_qkv_rope->attn_partial": "head"}},
        "steps": [[2, 100]]},
    "tiny-qwen3 QK-norm, head_dim 128, tiles of 3 whole heads, untied head": {
        "model": "tiny-qwen3", "kernel": {},
        "strategy": {"attn_splits": 2, "tiles": {"attn_norm_qkv_rope": 384}, "k_splits": {"o_proj_residual": 2}},
        "steps": [[7, 0], [3, 40]]},
    "tiny-qwen2 QKV bias, tiles of 3 whole heads (v9 needs them), tied head": {
        "model": "tiny-qwen2", "kernel": {},
        "strategy": {"attn_splits": 3, "tiles": {"attn_norm_qkv_rope": 96, "final_norm_lm_head": 40},
                     "k_splits": {"down_proj_residual": 2}},
        # not position 0: attention there returns the new v alone, and the interpreter's truncating bf16 cast of a
        # biased v puts the logits ~5.4e-3 off (3.9e-3 with a zero bias); a lost bias is ~0.2 off anywhere
        "steps": [[9, 33], [2, 50]]},
    "tiny, batch 3 at ragged positions: weight tiles shared, attention per sequence, K splits": {
        "model": "tiny", "batch": 3, "kernel": {},
        "strategy": {"attn_splits": 2, "k_splits": {"o_proj_residual": 2, "down_proj_residual": 2},
                     "tiles": {"mlp_norm_gate_up": 48, "final_norm_lm_head": 40}},
        "steps": [[[7, 3, 11], [0, 20, 33]], [[5, 9, 2], [40, 1, 63]]]},
    "tiny-qwen3, batch 2: QK-norm per sequence, head_dim 128, untied head": {
        "model": "tiny-qwen3", "batch": 2, "kernel": {},
        "strategy": {"attn_splits": 3, "tiles": {"attn_norm_qkv_rope": 256}, "qk_norm": "in_qkv"},  # v9's form
        "steps": [[[7, 4], [40, 3]]]},
    "tiny-qwen2, batch 5 (padded to 8 lanes): QKV bias per sequence, tied head": {
        "model": "tiny-qwen2", "batch": 5, "kernel": {},
        "strategy": {"attn_splits": 2, "tiles": {"attn_norm_qkv_rope": 96}},
        "steps": [[[9, 2, 5, 1, 7], [33, 50, 12, 40, 63]]]},
    "tiny schedule set: 1 attention split below position 16, 3 splits and K splits from 16": {
        "model": "tiny", "kernel": {}, "strategy": {},
        "set": {"bounds": [16, 64], "strategies": [
            {"attn_splits": 1},
            {"attn_splits": 3, "k_splits": {"o_proj_residual": 2}, "tiles": {"mlp_norm_gate_up": 64}}]},
        "steps": [[7, 3], [5, 40], [9, 15], [2, 16]], "members": [0, 1, 0, 1]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_matches_the_reference_on_the_cpu(name: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES[name])], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(steps) == len(CASES[name]["steps"])
    for step in steps:
        assert step["counters_ok"], step  # every instruction ran and signalled
        if step["vs_batch1"] is None:
            assert step["rel"] < 5e-3, step  # logits vs the PyTorch reference
        else:  # a batch: each sequence as the batch-1 build computes it alone, and near the reference
            assert step["vs_batch1"] < 1e-5 and step["rel"] < 1e-2, step
        assert step["kv"] < 0.05, step  # this token's K/V landed in the cache (bf16), nothing else moved
    if "members" in CASES[name]:  # each step ran the member whose range holds its position
        assert [step["member"] for step in steps] == CASES[name]["members"]


STAGE_SCRIPT = r"""
import json
import torch
import triton
import triton.language as tl
from megasynth.kernels.gpu import ops

@triton.jit
def stage(vs_ptr, v_ptr, nw_ptr, k0, k1, NORM: tl.constexpr, H: tl.constexpr, BATCH: tl.constexpr,
          BB: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr):
    ops.stage_batch(vs_ptr, v_ptr, H, nw_ptr, k0, k1, NORM, H, 1e-5, BATCH, BB, BK, KS)

torch.manual_seed(0)
H, BATCH, BB, BK, KS = 96, 3, 8, 32, 160
v = torch.randn(BATCH, H)
nw = torch.rand(H) + 0.5
out = {}
for norm, (k0, k1) in ((True, (0, H)), (False, (16, 86))):
    vs = torch.full((2 * BB, KS), 7.0).to(torch.bfloat16)
    stage[(1,)](vs, v, nw, k0, k1, norm, H, BATCH, BB, BK, KS)
    want = v * torch.rsqrt(v.pow(2).mean(1, keepdim=True) + 1e-5) * nw if norm else v
    want = want[:, k0:k1]
    n = k1 - k0
    nup = -(-n // BK) * BK
    f = vs.float()
    got = f[:BATCH, :n] + f[BB:BB + BATCH, :n]
    out[str(norm)] = {
        "rel": float((got - want).norm() / want.norm()),
        "hi_is_bf16_of_v": float((f[:BATCH, :n] - want).abs().max() / want.abs().max()),
        "zero_past_k1": float(f[:, n:nup].abs().max()) if nup > n else 0.0,
        "zero_padding_rows": float(torch.cat([f[BATCH:BB, :nup], f[BB + BATCH:, :nup]]).abs().max()),
        "untouched_past_block": bool((f[:, nup:] == 7.0).all()),
    }
print(json.dumps(out))
"""


def test_a_batch_stages_each_sequence_as_bf16_hi_and_lo_rows_on_the_cpu() -> None:
    """ops.stage_batch (the tensor-core batch path's operand, built once per instruction): row b of the scratch is
    sequence b's normalised vector in bf16, row BB + b its remainder, so hi + lo is the fp32 vector; zero past the K
    range up to the K block and in the padding sequences' rows; nothing written past the block."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", STAGE_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for norm, r in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert r["rel"] < 1e-4, (norm, r)  # hi + lo: ~16 mantissa bits (the interpreter truncates to bf16)
        assert 1e-4 < r["hi_is_bf16_of_v"] < 1e-2, (norm, r)  # hi alone carries bf16's error: lo is not empty
        assert r["zero_past_k1"] == 0.0 and r["zero_padding_rows"] == 0.0, (norm, r)
        assert r["untouched_past_block"], (norm, r)
