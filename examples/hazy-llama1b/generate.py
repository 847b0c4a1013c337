#!/usr/bin/env python3
"""The published Llama-1B low-latency megakernel's counter protocol as `megakernel-schedule/1` files.

Source: HazyResearch/Megakernels at commit 7309cec801537b61fea3b50d7dfe454a6cde578e (the CUDA in
demos/low-latency-llama/ and include/, the Python scheduler in megakernels/). Every number and rule below is a row of
FACTS with the lines it was read from (path:line at that commit) and a word that occurs there (`anchor`, checked by
`--verify-citations GIT_DIR`). Where the Python scheduler and the CUDA disagree, the CUDA decides what the schedule
says (the CUDA is what runs); the Python is used for what only it decides: how work is cut into instructions, and
which SM runs which instruction (its assignment modes).

    python examples/hazy-llama1b/generate.py            # (re)write the committed schedules next to this file
    python examples/hazy-llama1b/generate.py --check    # exit 1 if a committed file differs from a regeneration
    python examples/hazy-llama1b/generate.py --mode dag --repaired --out /tmp/x.json

Plain Python (stdlib only): it writes JSON; `validate FILE` checks it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = "HazyResearch/Megakernels"
COMMIT = "7309cec801537b61fea3b50d7dfe454a6cde578e"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Fact:
    value: object  # the number (or rule name) the generator uses
    where: str  # "path:line" or "path:a-b", several joined by "; ", at COMMIT
    anchor: str  # a word that occurs in the first cited range (checked by --verify-citations)
    says: str  # what the cited lines establish


_LL = "demos/low-latency-llama/"
_SCHED = "megakernels/demos/latency/scheduler.py"
_INS = "megakernels/demos/latency/instructions.py"

FACTS: dict[str, Fact] = {
    # --- the machine: one CTA per SM, each walks the queue row of its SM; counters Bar[layer, opcode - 1, idx] ------
    "sms.h100": Fact(132, _LL + "llama.cuh:25,153-154", "H100_SM_COUNT",
                     "grid = 132 CTAs on a Hopper build (GPU=H100); the H200 has 132 SMs too"),
    "sms.b200": Fact(148, _LL + "llama.cuh:26,155-156; " + _LL + "Makefile:4-5,26-27", "B200_SM_COUNT",
                     "grid = 148 CTAs with KITTENS_BLACKWELL (the Makefile's default GPU=B200)"),
    "queue_row": Fact("smid", "include/util.cuh:27-30; include/controller/instruction_fetch.cuh:16-17",
                      "get_smid", "a CTA runs the instruction row of the SM it sits on (%smid, not blockIdx.x)"),
    "pipeline_depth": Fact(2, "include/config.cuh:9; include/controller/controller.cuh:33-40",
                           "INSTRUCTION_PIPELINE_STAGES",
                           "an SM has two instruction slots: instruction i+1 may overlap i, i+2 waits for i to finish"),
    "bar_layout": Fact((10, 48), _SCHED + ":53-61; " + _LL + "llama.cuh:103-105", "barriers",
                       "Bar is int32 [num_layers, 10, 32 + 2*8]; an op signals slot opcode - 1"),
    "bar_zeroed": Fact(0, "megakernels/generators.py:115-116,132; megakernels/scripts/generate.py:41", "fill_",
                       "Bar is filled with barrier_fill_val = 0 before every step"),
    "hidden_in": Fact("hidden_states", "megakernels/generators.py:127-130", "hidden_states",
                      "the host writes the embedding into hidden_states before the launch (no instruction does)"),
    "linear_order": Fact("dag order", "megakernels/scheduler.py:55-57; megakernels/generators.py:177,191",
                         "get_linear_instructions",
                         "the Python VM (the reference) runs the instructions one at a time in DAG-list order: "
                         "our ids follow that order, so ascending id order is the reference execution"),
    # --- model sizes -------------------------------------------------------------------------------------------------
    "layers": Fact(16, _LL + "llama.cuh:15", "LLAMA_1B_NUM_LAYERS", "16 layers"),
    "hidden": Fact(2048, _LL + "llama.cuh:16", "LLAMA_1B_HIDDEN_DIM", "hidden size"),
    "intermediate": Fact(8192, _LL + "llama.cuh:17", "LLAMA_1B_INTERMEDIATE_DIM", "MLP size"),
    "head_dim": Fact(64, _LL + "llama.cuh:18", "LLAMA_1B_HEAD_DIM", "head dim"),
    "q_heads": Fact(32, _LL + "llama.cuh:19", "LLAMA_1B_NUM_ATTENTION_HEADS", "query heads"),
    "kv_heads": Fact(8, _LL + "llama.cuh:20", "LLAMA_1B_NUM_KV_HEADS", "KV heads (GQA ratio 4)"),
    "kv_block": Fact(16, _LL + "llama.cuh:21", "LLAMA_1B_KV_BLOCK_SIZE",
                     "attention walks the KV cache in 16-position blocks"),
    "block": Fact(16, _LL + "llama.cuh:22; " + _SCHED + ":104-110", "LLAMA_1B_MATVEC_BLOCK_SIZE",
                  "every matvec output block is 16 rows (the scheduler's *_block_size = 16 agree, the LM head "
                  "included; LLAMA_1B_LM_HEAD_BLOCK_SIZE = 32 at llama.cuh:23 is never used)"),
    "vocab": Fact(128256, _LL + "llama.cuh:24", "LLAMA_1B_VOCAB_SIZE", "vocabulary"),
    "max_len": Fact(16384, "megakernels/scripts/generate.py:43; megakernels/llama.py:552-567", "max_len_override",
                    "the KV cache holds 16384 positions per layer and head"),
    "consumer_warps": Fact(16, "include/config.cuh:25; " + _LL + "matvec_pipeline.cuh:14-15", "NUM_CONSUMER_WARPS",
                           "16 consumer warps each load 2048/16 = 128 input elements: a matvec reads its whole input"),
    # --- opcodes (an op's counters live in slot opcode - 1) ----------------------------------------------------------
    "op.qkv": Fact(1, _LL + "llama.cuh:7", "OPCODE_RMS_QKV_MatVecRopeAppend",
                   "RMS norm + QKV matvec + RoPE + KV append"),
    "op.partial": Fact(2, _LL + "llama.cuh:8", "OPCODE_PartialAttention", "attention over a KV range, 4 q heads"),
    "op.reduction": Fact(3, _LL + "llama.cuh:9", "OPCODE_AttentionReduction", "merge of partials (not scheduled)"),
    "op.o_proj": Fact(4, _LL + "llama.cuh:10", "OPCODE_O_ProjResidual", "o_proj matvec, added into hidden_states"),
    "op.upgate": Fact(5, _LL + "llama.cuh:11", "OPCODE_RMS_DoubleMatVecSiLU", "RMS norm + up/gate matvecs + SiLU"),
    "op.down": Fact(6, _LL + "llama.cuh:12", "OPCODE_DownProjResidual", "down matvec, added into hidden_states"),
    "op.lm_head": Fact(7, _LL + "llama.cuh:13", "OPCODE_RMS_LM_Head", "final RMS norm + LM head"),
    # --- rms_qkv_rope_append: words [1, layer, start_block, end_block] -----------------------------------------------
    "qkv.words": Fact("layer,start,end", _LL + "rms_matvec_rope_append.cu:38-41", "start_block_idx",
                      "instruction words: layer, first and last+1 16-row output block of the 3072 QKV rows"),
    "qkv.wait": Fact(512, _LL + "rms_matvec_rope_append.cu:17,52-58", "EXPECTED_ARRIVAL_COUNT",
                     "layer > 0 waits Bar[layer-1, down-1, 0] >= 512 (every down_proj block of the previous layer); "
                     "layer 0 waits for nothing"),
    "qkv.reads": Fact("hidden_states", _LL + "rms_matvec_rope_append.cu:170-173; " + _LL
                      + "matvec_pipeline.cuh:326-334", "hidden_states",
                      "after its wait the consumer loads all of hidden_states (the RMS norm input)"),
    "qkv.k_start": Fact(128, _LL + "rms_matvec_rope_append.cu:15", "K_BLK_START", "blocks 0-127 are Q, 128-159 K"),
    "qkv.v_start": Fact(160, _LL + "rms_matvec_rope_append.cu:16", "V_BLK_START", "blocks 160-191 are V"),
    "qkv.writes": Fact("q|k|v", _LL + "rms_matvec_rope_append.cu:129-151", "q_post_rope",
                       "a Q block goes to q_post_rope[16b, +16); a K/V block to k_cache/v_cache[layer, pos_id, "
                       "head, 16-dim chunk] with head = 16(b - start)/64"),
    "qkv.signal": Fact(1, _LL + "rms_matvec_rope_append.cu:156,161-162", "atomicAdd",
                       "after each block's store completes: Bar[layer, qkv-1, block/4] += 1 (one counter per head: "
                       "0-31 Q, 32-39 K, 40-47 V; 4 blocks per head)"),
    # --- attention_partial: words [2, layer, kv_head, num_partials, partial_idx] -------------------------------------
    "partial.words": Fact("layer,kv_head,num_partials,partial_idx", _LL + "attention_partial.cu:44-50",
                          "kv_head_idx", "instruction words"),
    "partial.wait_q": Fact(4, _LL + "attention_partial.cu:393-405", "q_head_start_idx",
                           "before loading Q: Bar[layer, qkv-1, 4h + j] >= 4 for j = 0..3 (its four q heads)"),
    "partial.wait_kv": Fact(4, _LL + "attention_partial.cu:308-327,368-371", "wait_for_kv",
                            "Bar[layer, qkv-1, 32 + h] >= 4 and Bar[layer, qkv-1, 40 + h] >= 4, waited only before "
                            "the last KV block of the partial with partial_idx == num_partials - 1"),
    "partial.range": Fact("blocks", _LL + "attention_partial.cu:340-348,357-382", "blocks_per_partial",
                          "it loads KV blocks [p*ceil(T/16/P), min(+that, ceil(T/16))) of its head, T = pos_id + 1, "
                          "16 positions each (TMA tiles: positions past pos_id are loaded, then masked)"),
    "partial.reads_q": Fact(256, _LL + "attention_partial.cu:249-273,447", "load_Q_async",
                            "Q: q_post_rope[256h, 256h + 256) (4 heads x 64)"),
    "partial.skip": Fact(True, _SCHED + ":40,96,276; " + _LL + "attention_partial.cu:609-615", "skip_attn_reduction",
                         "the latency scheduler always sets skip_attn_reduction: each partial writes attn_out itself"),
    "partial.writes": Fact(256, _LL + "attention_partial.cu:572-579", "attn_out",
                           "attn_out[256h, 256h + 256) (skip path)"),
    "partial.signal": Fact(4, _LL + "attention_partial.cu:644-660", "OPCODE_AttentionReduction",
                           "lanes 0-3 each add 1 to Bar[layer, reduction-1, 0] (skip path): +4 per partial"),
    "partial.count": Fact(1, _SCHED + ":276-277,302-309", "num_attention_partitions",
                          "one partial per KV head (num_partials = 1, partial_idx = 0)"),
    # --- o_proj / downproj: MatVecAddOp, words [op, layer, start_block, end_block, reduction_block] -------------------
    "matvec_add.words": Fact("layer,start,end,reduction_block", _LL + "matvec_adds.cu:26-33", "reduction_block_idx",
                             "instruction words; the input is columns [2048 rb, 2048 rb + 2048)"),
    "matvec_add.wait": Fact("Bar[layer, prev_opcode-1, rb]", _LL + "matvec_adds.cu:129-133", "prev_opcode",
                            "waits Bar[layer, prev_opcode - 1, reduction_block] >= EXPECTED_ARRIVAL_COUNT"),
    "matvec_add.reads": Fact(2048, _LL + "matvec_adds.cu:142-147", "start_reduction_col",
                             "each of the 16 consumer warps loads 128 input columns: [2048 rb, 2048 rb + 2048)"),
    "matvec_add.reduces": Fact("store_add", _LL + "matvec_adds.cu:75-80", "store_add_async",
                               "each output block is added (TMA reduce-add) into the output at [16b, +16)"),
    "matvec_add.signal": Fact("iters", _LL + "matvec_adds.cu:165-175", "inst.iters",
                              "after all stores complete: Bar[layer, opcode-1, 0] += end - start"),
    "o_proj.params": Fact(32, _LL + "matvec_adds.cu:188-192", "num_attention_heads",
                          "o_proj: EXPECTED = 32, prev_opcode = o_proj - 1 = 3 (slot 2, the partials' counter), "
                          "input attn_out, output hidden_states"),
    "down.params": Fact(128, _LL + "matvec_adds.cu:181-186", "OPCODE_DownProjResidual - 1",
                        "downproj: EXPECTED = 2048/16 = 128, prev_opcode = down - 1 = 5 (slot 4, upgate's counters), "
                        "input silu_out, output hidden_states"),
    # --- rms_upgate_silu: words [5, layer, n, block_0, ..., block_{n-1}] ---------------------------------------------
    "upgate.words": Fact("layer,n,blocks", _LL + "upgate.cu:21-26", "block_idxs",
                         "instruction words: layer, a count, then that many (any) 16-row blocks of the 8192 rows"),
    "upgate.wait": Fact(128, _LL + "upgate.cu:14-16,35-39", "EXPECTED_ARRIVAL_COUNT",
                        "waits Bar[layer, o_proj-1, 0] >= 2048/16 = 128 (every o_proj block)"),
    "upgate.reads": Fact("hidden_states", _LL + "upgate.cu:129-132; " + _LL + "matvec_pipeline.cuh:326-334",
                         "hidden_states", "after its wait the consumer loads all of hidden_states (RMS norm input)"),
    "upgate.writes": Fact(16, _LL + "upgate.cu:109-110", "silu_out", "silu_out[16b, +16) per block"),
    "upgate.signal": Fact(1, _LL + "upgate.cu:111,116-120", "atomicAdd",
                          "after each block's store completes: Bar[layer, upgate-1, 16b/2048] += 1, one counter per "
                          "2048-column slice of silu_out (the slice one downproj instruction reads)"),
    # --- rms_lm_head: words [7, start_block, end_block] -------------------------------------------------------------
    "lm_head.words": Fact("start,end", _LL + "rms_lm_head.cu:18-22", "start_block_idx", "instruction words"),
    "lm_head.wait": Fact(512, _LL + "rms_lm_head.cu:14,29-37", "EXPECTED_ARRIVAL_COUNT",
                         "waits Bar[15, down-1, 0] >= 512 (the last layer's down_proj)"),
    "lm_head.reads": Fact("hidden_states", _LL + "rms_lm_head.cu:80-83; " + _LL + "matvec_pipeline.cuh:326-334",
                          "hidden_states", "reads all of hidden_states"),
    "lm_head.writes": Fact(16, _LL + "rms_lm_head.cu:68-73", "logits", "logits[16b, +16); it signals nothing"),
    # --- the Python scheduler: how work is cut, and the SM-assignment modes -------------------------------------------
    "sched.layer": Fact("qkv,partial,o_proj,upgate,down", _SCHED + ":245-262,281-386", "make_dag_layer",
                        "per layer, in this order; then the LM head"),
    "sched.qkv": Fact("round", _SCHED + ":118-142", "blocks_per_sm",
                      "one QKV instruction per SM: blocks [round(s*192/n), round((s+1)*192/n))"),
    "sched.o_proj": Fact(1, _SCHED + ":343-352", "o_block_idx", "one o_proj instruction per output block, rb = 0"),
    "sched.upgate": Fact("strided", _SCHED + ":145-164", "range(sm_idx, num_up_gate_blocks, sm_count)",
                         "one upgate instruction per SM: blocks s, s + n, s + 2n, ... (strided over all 512)"),
    "sched.down": Fact("jobs", _SCHED + ":167-213", "jobs_per_sm",
                       "512 (rb, block) jobs cut into n instructions, each within one rb, about 512/n blocks each"),
    "sched.lm_head": Fact("round", _SCHED + ":216-232", "blocks_per_sm",
                          "one LM-head instruction per SM: blocks [round(s*8016/n), round((s+1)*8016/n))"),
    "sched.dag_deps": Fact("python", _SCHED + ":281-292,311-336,354,365,377; " + _SCHED + ":256-262",
                           "DAG_Node",
                           "DAG edges: qkv <- all down of the previous layer; partial <- the QKV nodes of its K and V "
                           "blocks (not Q); o_proj <- all partials; upgate <- all o_proj; down <- ALL upgates; "
                           "LM head <- last layer's down. Used here only for the 'dag' mode's order"),
    "sched.cost": Fact("cost", _INS + ":53-58,76-81,126-131,151-157,170-175,191-196", "def cost",
                       "instruction costs for the 'wave' and 'dag' modes: rows x 2048 per matvec block (x2 for "
                       "up+gate), (pos_id + 1)/num_partials x 128 for a partial"),
    "sched.pos_at_build": Fact(0, _SCHED + ":93; megakernels/scripts/generate.py:139-144", "pos_id=0",
                               "the schedule is built and assigned once with pos_id = 0, then reused at every step"),
    "mode.rr": Fact("rr", "megakernels/scheduler.py:154-161,257-258; megakernels/scripts/generate.py:47",
                    "i % sm_count",
                    "round-robin: instruction i of the linear list to SM i mod n (the default sched)"),
    "mode.zz": Fact("zz", "megakernels/scheduler.py:164-175,259-260", "zig_zag",
                    "zig-zag: 0..n-1 then n-1..0, repeating"),
    "mode.wave": Fact("wave", "megakernels/scheduler.py:178-217,261-262", "collect_into_waves",
                      "runs of equal opcode, each sorted by cost (largest first, stable), to the least-loaded SM"),
    "mode.dag": Fact("dag", "megakernels/scheduler.py:94-151,263-264", "assign_dag_to_sms",
                     "list scheduling over the DAG: largest ready cost first (ties: lowest index) onto the SM that "
                     "frees first (ties: lowest SM); its start time ignores readiness"),
    "mode.pool": Fact("pool", "megakernels/scheduler.py:220-242,265-269; megakernels/instructions.py:93-95", "pool",
                      "needs tags()['pool'], which the latency instructions do not define (tags() = {}): KeyError, "
                      "so this mode does not apply to this demo"),
    # --- where the Python's model of the protocol is stricter than the CUDA (not used; see docs/examples.md) ---------
    "pyvm.down_join": Fact(512, "megakernels/demos/latency/python_vm.py:107-110,142,165", "512",
                           "the Python VM counts every upgate block on Bar[layer, 4, 0] and down asserts it is 512 "
                           "(all upgate work done); the CUDA counts per 2048-column slice and waits for 128"),
    "sched.down_todo": Fact("todo", _SCHED + ":373", "TODO",
                            "'we can start a reduction col's work once that fraction of the upgate work is done': "
                            "what the CUDA does"),
}


def f(name: str):
    """The value of one fact."""
    return FACTS[name].value


# ----------------------------------------------------------------------------------------------------------------------
# The instructions, as the Python scheduler cuts the work (facts sched.*), with what the CUDA does (the other facts).


@dataclass
class Ins:
    op: str
    opcode: int
    layer: int | None
    args: dict
    waits: list[tuple[int, int]]
    signals: list[tuple[int, int]]
    reads: list[tuple[str, int, int]]
    writes: list[tuple[str, int, int]]
    reduces: list[tuple[str, int, int]]
    cost: float
    deps: list[int]  # indices of the Python DAG's dependencies (for the 'dag' mode only)
    blocks: list[tuple[tuple[str, int, int], int]] = field(default_factory=list)  # per output block: region, counter


def bar(layer: int, opcode: int, idx: int) -> int:
    """Counter id of Bar[layer, opcode - 1, idx]: its flat index in the int32 tensor (fact bar_layout)."""
    slots, width = f("bar_layout")
    return (layer * slots + opcode - 1) * width + idx


def _merge(regions: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Sorted, adjacent ranges of one buffer joined (the same elements, fewer records)."""
    out: list[tuple[str, int, int]] = []
    for buf, lo, hi in sorted(regions):
        if out and out[-1][0] == buf and out[-1][2] == lo:
            out[-1] = (buf, out[-1][1], hi)
        else:
            out.append((buf, lo, hi))
    return out


def _sum_signals(adds: list[int]) -> list[tuple[int, int]]:
    """Per-block `+1`s on counters as one signal per counter, at the end (docs/examples.md, 'simplifies')."""
    total: dict[int, int] = {}
    for c in adds:
        total[c] = total.get(c, 0) + 1
    return sorted(total.items())


def kv_index(layer: int, head: int, pos: int) -> int:
    """Element index of k_cache/v_cache[layer, pos, head, 0], numbered layer, head, position, dim: a relabelling of
    the CUDA's [layer, pos, head, dim] (llama.cuh:94) under which one head's positions are one range."""
    return ((layer * f("kv_heads") + head) * f("max_len") + pos) * f("head_dim")


def qkv(layer: int, start: int, end: int, pos_id: int) -> Ins:
    b, hd = f("block"), f("head_dim")
    writes, adds = [], []
    for blk in range(start, end):
        if blk < f("qkv.k_start"):
            writes.append(("q_post_rope", b * blk, b * blk + b))
        else:
            first, buf = (f("qkv.k_start"), "k_cache") if blk < f("qkv.v_start") else (f("qkv.v_start"), "v_cache")
            head, chunk = divmod(b * (blk - first), hd)
            lo = kv_index(layer, head, pos_id) + chunk
            writes.append((buf, lo, lo + b))
        adds.append(bar(layer, f("op.qkv"), blk // (hd // b)))
    waits = [] if layer == 0 else [(bar(layer - 1, f("op.down"), 0), f("qkv.wait"))]
    return Ins("rms_qkv_rope_append", f("op.qkv"), layer, {"start_block": start, "end_block": end}, waits,
               _sum_signals(adds), [("hidden_states", 0, f("hidden"))], _merge(writes), [],
               (end - start) * b * f("hidden"), [], list(zip(writes, adds, strict=True)))


def partial(layer: int, kv_head: int, num_partials: int, partial_idx: int, pos_id: int) -> Ins:
    ratio, hd, kvb = f("q_heads") // f("kv_heads"), f("head_dim"), f("kv_block")
    seq_len = pos_id + 1
    total = -(-seq_len // kvb)
    per = -(-total // num_partials)
    lo_blk = partial_idx * per
    hi_blk = min(lo_blk + per, total)
    waits = [(bar(layer, f("op.qkv"), kv_head * ratio + j), f("partial.wait_q")) for j in range(ratio)]
    if hi_blk > lo_blk and partial_idx == num_partials - 1:  # fact partial.wait_kv
        waits += [(bar(layer, f("op.qkv"), f("q_heads") + kv_head), f("partial.wait_kv")),
                  (bar(layer, f("op.qkv"), f("q_heads") + f("kv_heads") + kv_head), f("partial.wait_kv"))]
    reads = [("q_post_rope", kv_head * f("partial.reads_q"), (kv_head + 1) * f("partial.reads_q"))]
    if hi_blk > lo_blk:
        for buf in ("k_cache", "v_cache"):
            reads.append((buf, kv_index(layer, kv_head, lo_blk * kvb), kv_index(layer, kv_head, hi_blk * kvb)))
    writes = [("attn_out", kv_head * f("partial.writes"), (kv_head + 1) * f("partial.writes"))]
    signals = [(bar(layer, f("op.reduction"), 0), f("partial.signal"))]
    cost = seq_len / num_partials * hd * 2
    return Ins("attention_partial", f("op.partial"), layer,
               {"kv_head": kv_head, "num_partials": num_partials, "partial_idx": partial_idx},
               sorted(waits), signals, reads, writes, [], cost, [])


def matvec_add(kind: str, layer: int, start: int, end: int, rb: int) -> Ins:
    b, h = f("block"), f("hidden")
    opcode, src, expected = ((f("op.o_proj"), "attn_out", f("o_proj.params")) if kind == "o_proj"
                             else (f("op.down"), "silu_out", f("down.params")))
    prev_opcode = opcode - 1  # its counters live in slot prev_opcode - 1 (facts o_proj.params, down.params)
    return Ins(kind, opcode, layer, {"start_block": start, "end_block": end, "reduction_block": rb},
               [(bar(layer, prev_opcode, rb), expected)], [(bar(layer, opcode, 0), end - start)],
               [(src, rb * f("matvec_add.reads"), (rb + 1) * f("matvec_add.reads"))], [],
               [("hidden_states", b * start, b * end)], (end - start) * b * h, [])


def upgate(layer: int, blocks: list[int]) -> Ins:
    b, h = f("block"), f("hidden")
    writes = [("silu_out", b * blk, b * blk + b) for blk in blocks]
    adds = [bar(layer, f("op.upgate"), b * blk // h) for blk in blocks]
    return Ins("rms_upgate_silu", f("op.upgate"), layer, {"block_idxs": list(blocks)},
               [(bar(layer, f("op.o_proj"), 0), f("upgate.wait"))], _sum_signals(adds),
               [("hidden_states", 0, h)], _merge(writes), [], len(blocks) * b * h * 2, [],
               list(zip(writes, adds, strict=True)))


def lm_head(start: int, end: int) -> Ins:
    b, h = f("block"), f("hidden")
    return Ins("rms_lm_head", f("op.lm_head"), None, {"start_block": start, "end_block": end},
               [(bar(f("layers") - 1, f("op.down"), 0), f("lm_head.wait"))], [],
               [("hidden_states", 0, h)], [("logits", b * start, b * end)], [], (end - start) * b * h, [])


def _even_split(total: int, n: int) -> list[tuple[int, int]]:
    """[round(s*total/n), round((s+1)*total/n)) for each s: Python's round, as the scheduler uses (fact sched.qkv)."""
    per = total / n
    assert per > 1
    return [(round(s * per), round((s + 1) * per)) for s in range(n)]


def _down_split(n: int) -> list[tuple[int, int, int]]:
    """(rb, start, end) per SM, cut as schedule_downproj cuts its 512 jobs (fact sched.down)."""
    blocks = f("hidden") // f("block")
    jobs = [(rb, blk) for rb in range(f("intermediate") // f("hidden")) for blk in range(blocks)]
    out, done = [], 0
    for s in range(n):
        per = (len(jobs) - done) / (n - s)
        assert per > 1
        chunk = jobs[done:done + round(per)]
        same = [j for j in chunk if j[0] == chunk[0][0]]
        out.append((same[0][0], same[0][1], same[0][1] + len(same)))
        done += len(same)
    return out


def build(n: int, pos_id: int) -> list[Ins]:
    """The linear instruction list (fact linear_order) with each instruction's Python DAG dependencies."""
    b, hd = f("block"), f("head_dim")
    out: list[Ins] = []
    prev_down: list[int] = []
    for layer in range(f("layers")):
        qkv_idx = []
        owner: dict[int, int] = {}
        for start, end in _even_split((f("q_heads") + 2 * f("kv_heads")) * hd // b, n):
            ins = qkv(layer, start, end, pos_id)
            ins.deps = list(prev_down)
            qkv_idx.append(len(out))
            owner.update({blk: len(out) for blk in range(start, end)})
            out.append(ins)
        partials = []
        for h in range(f("kv_heads")):
            ins = partial(layer, h, f("partial.count"), 0, pos_id)
            k0, v0 = (f("q_heads") + h) * hd // b, (f("q_heads") + f("kv_heads") + h) * hd // b
            ins.deps = sorted({owner[blk] for blk in [*range(k0, k0 + hd // b), *range(v0, v0 + hd // b)]})
            partials.append(len(out))
            out.append(ins)
        o_projs = []
        for blk in range(f("hidden") // b):
            ins = matvec_add("o_proj", layer, blk, blk + 1, 0)
            ins.deps = list(partials)
            o_projs.append(len(out))
            out.append(ins)
        upgates = []
        for s in range(n):
            ins = upgate(layer, list(range(s, f("intermediate") // b, n)))
            ins.deps = list(o_projs)
            upgates.append(len(out))
            out.append(ins)
        prev_down = []
        for rb, start, end in _down_split(n):
            ins = matvec_add("downproj", layer, start, end, rb)
            ins.deps = list(upgates)
            prev_down.append(len(out))
            out.append(ins)
    for start, end in _even_split(f("vocab") // b, n):
        ins = lm_head(start, end)
        ins.deps = list(prev_down)
        out.append(ins)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# SM-assignment modes (facts mode.*): each returns, per SM, the indices into the linear list it runs, in order.


def assign_rr(ins: list[Ins], n: int) -> list[list[int]]:
    return [list(range(s, len(ins), n)) for s in range(n)]


def assign_zz(ins: list[Ins], n: int) -> list[list[int]]:
    queues: list[list[int]] = [[] for _ in range(n)]
    for i in range(len(ins)):
        k = i % (2 * n)
        queues[k if k < n else 2 * n - 1 - k].append(i)
    return queues


def assign_wave(ins: list[Ins], n: int) -> list[list[int]]:
    queues: list[list[int]] = [[] for _ in range(n)]
    load = [(0.0, s) for s in range(n)]
    i = 0
    while i < len(ins):
        j = i
        while j < len(ins) and ins[j].opcode == ins[i].opcode:
            j += 1
        for k in sorted(range(i, j), key=lambda k: ins[k].cost, reverse=True):
            cost, s = heapq.heappop(load)
            heapq.heappush(load, (cost + ins[k].cost, s))
            queues[s].append(k)
        i = j
    return queues


def assign_dag(ins: list[Ins], n: int) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in ins]
    remaining = [len(x.deps) for x in ins]
    for i, x in enumerate(ins):
        for d in x.deps:
            children[d].append(i)
    ready = [(-x.cost, i) for i, x in enumerate(ins) if not x.deps]
    heapq.heapify(ready)
    free = [(0.0, s) for s in range(n)]
    queues: list[list[int]] = [[] for _ in range(n)]
    while ready:
        _, i = heapq.heappop(ready)
        t, s = heapq.heappop(free)
        queues[s].append(i)
        heapq.heappush(free, (t + ins[i].cost, s))
        for c in children[i]:
            remaining[c] -= 1
            if remaining[c] == 0:
                heapq.heappush(ready, (-ins[c].cost, c))
    return queues


MODES = {"rr": assign_rr, "zz": assign_zz, "wave": assign_wave, "dag": assign_dag}


# ----------------------------------------------------------------------------------------------------------------------
# The repair: downproj waits for all four 2048-column counters of upgate (what the Python VM asserts, fact
# pyvm.down_join), so no downproj can add into hidden_states before every upgate instruction has read it.


def repair(ins: list[Ins]) -> None:
    slices = f("intermediate") // f("hidden")
    for x in ins:
        if x.op == "downproj":
            x.waits = [(bar(x.layer, f("op.upgate"), rb), f("down.params")) for rb in range(slices)]


def pieces(x: Ins) -> list[Ins]:
    """The finer encoding (`--fine`): a QKV or upgate instruction as one piece per output block, in order on its
    SM, each signalling right after its block (facts qkv.signal, upgate.signal); the first piece does the
    instruction's one read of hidden_states and its waits. A partial as two pieces: lanes 1-3 add 3 as soon as the
    attention is computed, lane 0 adds 1 after its attn_out store completes (fact partial.signal: each lane waits
    only for its own bulk stores, and only lane 0 issued any)."""
    if x.blocks:
        out = []
        for k, (region, counter) in enumerate(x.blocks):
            out.append(replace(x, waits=x.waits if k == 0 else [], reads=x.reads if k == 0 else [],
                               writes=[region], signals=[(counter, 1)], args={**x.args, "piece": k}, blocks=[]))
        return out
    if x.op == "attention_partial":
        (counter, add), = x.signals
        return [replace(x, writes=[], signals=[(counter, add - 1)], args={**x.args, "piece": "lanes 1-3"}),
                replace(x, waits=[], reads=[], signals=[(counter, 1)], args={**x.args, "piece": "lane 0"})]
    return [x]


def schedule(mode: str, repaired: bool = False, sms: int | None = None, pos_id: int = 1023,
             fine: bool = False) -> dict:
    """One schedule document. The instructions and their costs are built with pos_id = 0, as the Python builds and
    assigns them once (fact sched.pos_at_build); the footprints are those of the step at `pos_id`."""
    n = sms or f("sms.h100")
    order = MODES[mode](build(n, 0), n)
    ins = build(n, pos_id)
    if repaired:
        repair(ins)
    ids: list[list[int]] = []
    flat: list[Ins] = []
    for x in ins:
        parts = pieces(x) if fine else [x]
        ids.append(list(range(len(flat), len(flat) + len(parts))))
        flat += parts
    h, kv = f("hidden"), f("layers") * f("kv_heads") * f("max_len") * f("head_dim")
    slots, width = f("bar_layout")
    name = f"hazy-llama1b-{mode}" + ("-repaired" if repaired else "") + ("-fine" if fine else "")
    return {
        "format": "megakernel-schedule/1",
        "target": {"workers": n, "device": "NVIDIA H100/H200 (GPU=H100 build)" if n == 132 else f"{n} SMs"},
        "buffers": {"hidden_states": h, "q_post_rope": h, "attn_out": h, "silu_out": f("intermediate"),
                    "logits": f("vocab"), "k_cache": kv, "v_cache": kv},
        "counters": f("layers") * slots * width,
        "meta": {
            "name": name,
            "source": {"repo": REPO, "commit": COMMIT, "demo": "demos/low-latency-llama (Llama-3.2-1B, latency)"},
            "assignment_mode": mode,
            "pos_id": pos_id,
            "repaired": repaired,
            "fine": fine,
            "counter": "counter c = (layer * 10 + opcode - 1) * 48 + idx is Bar[layer, opcode - 1, idx]",
            "k_cache": "element ((layer * 8 + head) * 16384 + pos) * 64 + dim is k_cache[layer, pos, head, dim]",
            "generator": "examples/hazy-llama1b/generate.py (every fact cited there as path:line at the commit)",
        },
        "instructions": [_ins_json(i, x) for i, x in enumerate(flat)],
        "queues": [[j for i in queue for j in ids[i]] for queue in order],
    }


def _ins_json(i: int, x: Ins) -> dict:
    out: dict = {"id": i, "op": x.op}
    if x.layer is not None:
        out["layer"] = x.layer
    out["args"] = x.args
    for key, vals in (("waits", [{"counter": c, "value": v} for c, v in x.waits]),
                      ("signals", [{"counter": c, "add": a} for c, a in x.signals]),
                      ("reads", [{"buffer": bf, "range": [lo, hi]} for bf, lo, hi in x.reads]),
                      ("writes", [{"buffer": bf, "range": [lo, hi]} for bf, lo, hi in x.writes]),
                      ("reduces", [{"buffer": bf, "range": [lo, hi]} for bf, lo, hi in x.reduces])):
        if vals:
            out[key] = vals
    return out


def dumps(doc: dict) -> str:
    """Deterministic text: the header indented, one instruction and one queue per line."""
    compact = {"separators": (",", ":")}
    head = {k: v for k, v in doc.items() if k not in ("instructions", "queues")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines.append('  "instructions": [')
    lines += [f"    {json.dumps(x, **compact)}," for x in doc["instructions"]]
    lines[-1] = lines[-1].rstrip(",")
    lines.append("  ],")
    lines.append('  "queues": [')
    lines += [f"    {json.dumps(q, **compact)}," for q in doc["queues"]]
    lines[-1] = lines[-1].rstrip(",")
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


#: The committed files: the default assignment mode (rr) as published and repaired (the README's demo). The other
#: modes (`--mode zz|wave|dag`) are 2.9 MB each and are generated on demand (the example tests validate them).
COMMITTED = [("rr", False), ("rr", True)]


def committed_name(mode: str, repaired: bool) -> str:
    return f"hazy-llama1b-{mode}" + ("-repaired" if repaired else "") + ".json"


def verify_citations(git_dir: str) -> list[str]:
    """Problems with the citations: a cited file or line missing at COMMIT, or an anchor not in its first range."""
    problems = []
    cache: dict[str, list[str]] = {}
    for name, fact in FACTS.items():
        for k, ref in enumerate(fact.where.split("; ")):
            path, _, lines = ref.partition(":")
            if path not in cache:
                res = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{COMMIT}:{path}"],
                                     capture_output=True, text=True)
                cache[path] = res.stdout.splitlines() if res.returncode == 0 else []
            text = cache[path]
            if not text:
                problems.append(f"{name}: {path} not found at {COMMIT[:12]}")
                continue
            picked: list[str] = []
            for part in lines.split(","):
                lo, _, hi = part.partition("-")
                lo_i, hi_i = int(lo), int(hi or lo)
                if not 1 <= lo_i <= hi_i <= len(text):
                    problems.append(f"{name}: {ref} is outside the file's {len(text)} lines")
                picked += text[lo_i - 1:hi_i]
            if k == 0 and fact.anchor not in "\n".join(picked):
                problems.append(f"{name}: {fact.anchor!r} does not occur in {ref}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the committed files with a regeneration")
    ap.add_argument("--mode", choices=sorted(MODES), help="write one schedule (with --out) instead of the set")
    ap.add_argument("--repaired", action="store_true", help="with --mode: the repaired protocol")
    ap.add_argument("--sms", type=int, help=f"with --mode: SM count (default {f('sms.h100')}; B200 build: 148)")
    ap.add_argument("--pos", type=int, default=1023, help="with --mode: the step's pos_id (default 1023)")
    ap.add_argument("--fine", action="store_true", help="with --mode: one piece per output block (see pieces())")
    ap.add_argument("--out", help="with --mode: output file")
    ap.add_argument("--verify-citations", metavar="GIT_DIR", help="check every citation against a Megakernels git dir")
    args = ap.parse_args(argv)
    if args.verify_citations:
        problems = verify_citations(args.verify_citations)
        print("\n".join(problems) or f"{len(FACTS)} facts: every cited range exists and holds its anchor")
        return 1 if problems else 0
    if args.mode:
        text = dumps(schedule(args.mode, args.repaired, args.sms, args.pos, args.fine))
        if args.out:
            Path(args.out).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    stale = []
    for mode, repaired in COMMITTED:
        path = HERE / committed_name(mode, repaired)
        text = dumps(schedule(mode, repaired))
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent.parent)}")
    if stale:
        print("differs from a regeneration: " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
