"""CPU tests of the GPU interpreter's pack pass (schedule -> int32 tables) and of the shared trace format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megasynth.ir.catalogue import OPS
from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import parse_schedule
from megasynth.kernels.gpu import pack as P
from megasynth.lowering.lower import lower
from megasynth.lowering.models import get_model
from megasynth.lowering.strategy import Strategy
from megasynth.trace import TraceError, check_trace, from_raw, make_trace, read_trace, summarize, write_trace


@pytest.fixture(scope="module")
def schedule():
    s = lower(get_model("tiny"), 5, Strategy(attn_splits=3, k_splits={"o_proj_residual": 2, "down_proj_residual": 1}))
    doc = s.to_json()
    doc["queues"] = [list(reversed(q)) for q in doc["queues"]][::-1]  # packing follows the queues, not the ids
    return parse_schedule(doc)


def test_pack_tables_decode_back_to_the_schedule(schedule) -> None:
    packed = P.pack(schedule)
    by_id = schedule.by_id()
    assert packed.ins.dtype == np.int32 and packed.ins.shape == (len(by_id), P.ROW)
    assert packed.workers == len(schedule.queues) and packed.max_splits == 3
    for w, queue in enumerate(schedule.queues):
        rows = packed.ins[packed.qoff[w]:packed.qoff[w + 1]]
        assert [int(r[P.F_ID]) for r in rows] == queue  # queue order, no indirection
        for r in rows:
            ins = by_id[int(r[P.F_ID])]
            assert int(r[P.F_OP]) == P.OPCODES[ins.op]
            assert int(r[P.F_LAYER]) == (ins.layer or 0)
            assert [int(r[P.F_A0 + j]) for j in range(len(OPS[ins.op].args))] == \
                [ins.args[k] for k in OPS[ins.op].args]
            w0, wn, s0, sn = int(r[P.F_WOFF]), int(r[P.F_WN]), int(r[P.F_SOFF]), int(r[P.F_SN])
            assert [tuple(x) for x in packed.waits[w0:w0 + wn].tolist()] == [(x.counter, x.value) for x in ins.waits]
            assert [tuple(x) for x in packed.sigs[s0:s0 + sn].tolist()] == [(x.counter, x.add) for x in ins.signals]
            if ins.waits:
                assert (int(r[P.F_C0]), int(r[P.F_V0])) == (ins.waits[0].counter, ins.waits[0].value)
            if ins.signals:
                assert (int(r[P.F_SC0]), int(r[P.F_SA0])) == (ins.signals[0].counter, ins.signals[0].add)
    totals = np.zeros(schedule.counters, dtype=np.int64)
    for ins in schedule.instructions:
        for s in ins.signals:
            totals[s.counter] += s.add
    assert packed.expected_counters.tolist() == totals.tolist()


def test_warm_hints_point_at_the_same_workers_later_ops_of_the_layer(schedule) -> None:
    packed = P.pack(schedule)
    by_id = schedule.by_id()
    hinted = 0
    for w, queue in enumerate(schedule.queues):
        lo = int(packed.qoff[w])
        seen: set[int] = set()
        for pos, iid in enumerate(queue):
            ins, row = by_id[iid], packed.ins[lo + pos]
            first_of_layer = ins.layer is not None and ins.layer not in seen
            if ins.layer is not None:
                seen.add(ins.layer)
            for fld, op in P.WARM_OPS.items():
                later = [lo + p for p, j in enumerate(queue) if p > pos and by_id[j].op == op
                         and by_id[j].layer == ins.layer]
                want = later[0] if first_of_layer and later else -1  # only a layer's first instruction hints
                assert int(row[fld]) == want, (w, pos, ins.op, fld)
                if want >= 0:
                    hinted += 1
                    target = packed.ins[want]
                    assert int(target[P.F_OP]) == P.OPCODES[op] and int(target[P.F_LAYER]) == ins.layer
                    assert lo <= want < int(packed.qoff[w + 1])  # the same worker's queue
    assert hinted > 0


def test_pack_refuses_ops_it_cannot_execute() -> None:
    doc = {"format": "megakernel-schedule/1", "target": {"workers": 1}, "buffers": {"a": 4}, "counters": 0,
           "instructions": [{"id": 0, "op": "my_op", "writes": [{"buffer": "a", "range": [0, 4]}]}], "queues": [[0]]}
    with pytest.raises(ScheduleError, match="not a catalogue op"):
        P.pack(parse_schedule(doc))


def _qk_apart_schedule():
    """Tiny Qwen3 with the QK-norm apart from QKV: 24-row QKV tiles (12 RoPE pairs) that cut q and k heads."""
    return lower(get_model("tiny-qwen3"), 4, Strategy(qk_norm="apart", tiles={"attn_norm_qkv_rope": 24}))


def test_qk_norm_apart_packs_for_v10() -> None:
    """attn_norm_qkv_rope_sq and qk_norm_apply pack for v10 (the default) with their catalogue opcodes (the table's
    order: the earlier ops keep theirs) and arguments."""
    sched = _qk_apart_schedule()
    assert [P.OPCODES[op] for op in OPS] == list(range(len(OPS)))
    assert (P.OPCODES["attn_norm_qkv_rope_sq"], P.OPCODES["qk_norm_apply"]) == (9, 10)
    assert P.INTERPRETER_OPS["v10"] == set(OPS) == P.GPU_OPS
    for packed in (P.pack(sched), P.pack(sched, "v10")):
        assert packed.n == len(sched.instructions)
        by_id = sched.by_id()
        seen = set()
        for r in packed.ins:
            ins = by_id[int(r[P.F_ID])]
            seen.add(ins.op)
            assert int(r[P.F_OP]) == P.OPCODES[ins.op]
            if ins.op == "qk_norm_apply":
                assert int(r[P.F_A0]) == ins.args["kv_head"]
            elif ins.op == "attn_norm_qkv_rope_sq":
                assert (int(r[P.F_A0]), int(r[P.F_A0 + 1])) == (ins.args["start"], ins.args["end"])
        assert {"attn_norm_qkv_rope_sq", "qk_norm_apply"} <= seen and "attn_norm_qkv_rope" not in seen


def test_qk_norm_apart_is_refused_for_v9_by_name() -> None:
    """Interpreter v9 has neither op: packing for it names the op and the interpreter that runs it; the rest of a
    schedule packs for v9 as before, and an unknown interpreter is a plain error."""
    sched = _qk_apart_schedule()
    assert P.INTERPRETER_OPS["v9"] == set(OPS) - {"attn_norm_qkv_rope_sq", "qk_norm_apply"}
    with pytest.raises(ScheduleError, match=r"'attn_norm_qkv_rope_sq' has no GPU implementation in interpreter v9: "
                                            r"interpreter v10 runs it") as err:
        P.pack(sched, "v9")
    assert err.value.path.endswith(".op") and "qk_norm = 'in_qkv'" in str(err.value)
    P.pack(lower(get_model("tiny-qwen3"), 4), "v9")  # the QK-norm inside QKV: v9 runs it
    with pytest.raises(ValueError, match="interpreter must be one of"):
        P.pack(sched, "v8")


def test_megakernel_on_v9_refuses_qk_norm_apart() -> None:
    """Megakernel packs for the interpreter it runs: with v9's KernelConfig the apart ops are refused by name before
    anything is compiled (the CPU is enough to check)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from megasynth.kernels.gpu import KernelConfig, Megakernel
    from megasynth.kernels.weights import random_weights

    spec = get_model("tiny-qwen3")
    w = {k: v.to(torch.bfloat16) for k, v in random_weights(spec.config, seed=1).items()}
    with pytest.raises(ScheduleError, match="'attn_norm_qkv_rope_sq' has no GPU implementation in interpreter v9"):
        Megakernel(_qk_apart_schedule(), w, device="cpu", config=KernelConfig())


def test_trace_round_trip_summary_and_critical_path(tmp_path) -> None:
    # Two workers: #0 (w0) then #2 (w0); #1 (w1) waits for #0 and ends last.
    raw = [(0, 0, 2000, 0), (0, 3000, 9000, 1), (2000, 2000, 4000, 0), (0, 0, 0, 1)]  # the last one never ran
    trace = from_raw(raw, [0, 1, 2, 3], ["embed", "attn_partial", "embed", "embed"], [None, 0, None, None],
                     {"model": "tiny", "ctx": 8})
    path = tmp_path / "trace.json"
    write_trace(path, trace)
    back = read_trace(path)
    assert back == json.loads(json.dumps(trace))
    assert back["metadata"]["estimated"] is False
    events = [e for e in back["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["id"] for e in events} == {0, 1, 2}
    s = summarize(back, producers={1: [0], 2: [0]})
    assert s["makespan_us"] == pytest.approx(9.0)
    assert s["per_op"]["embed"]["count"] == 2 and s["per_op"]["attn_partial"]["total_us"] == pytest.approx(6.0)
    assert s["per_sm"][1]["wait_us"] == pytest.approx(3.0)
    assert [e["id"] for e in s["critical_path"]] == [0, 1]


def test_bad_traces_name_the_json_path(tmp_path) -> None:
    good = make_trace([], {"estimated": True})
    check_trace(good)
    bad = {"traceEvents": [{"ph": "X", "ts": 0, "dur": -1, "tid": 0, "args": {"id": 1}}]}
    with pytest.raises(TraceError, match=r"\$\.traceEvents\[0\]\.dur"):
        check_trace(bad, "t.json")
    (tmp_path / "cut.json").write_text('{"traceEvents": [')
    with pytest.raises(TraceError, match="invalid JSON"):
        read_trace(tmp_path / "cut.json")


def test_layer_chain_of_a_gzipped_trace(tmp_path) -> None:
    """A 6-layer chain a -> b per layer (a 2 us, b 3 us, 1 us between): period 6 us, hops 1 us, middle layers 1-4;
    the trace is read back from gzip, as runs store it."""
    from megasynth.atomic import write_gz_atomic
    from megasynth.trace import event, format_layer_chain, layer_chain

    evs, t, ident = [], 0.0, 0
    for layer in range(6):
        for op, dur in (("a", 2.0), ("b", 3.0)):
            evs.append(event(ident % 2, ident, op, layer, t, dur, 0.5 if ident else 0.0))
            t += dur + (1.0 if op == "b" else 0.0)
            ident += 1
    path = tmp_path / "trace.json.gz"
    write_gz_atomic(path, json.dumps(make_trace(evs, {})))
    summary = summarize(read_trace(path), {k: [k - 1] for k in range(1, ident)})
    chain = summary["layer_chain"]
    assert chain["layers"] == [1, 4]
    assert chain["period_us"] == pytest.approx(6.0)
    assert chain["per_op_us"] == pytest.approx({"b": 3.0, "a": 2.0})
    assert chain["hops_us"] == pytest.approx(1.0)
    assert "period 6.0 us = b 3.0, a 2.0, hops and waits 1.0" in format_layer_chain(chain)
    assert layer_chain([{"op": "a", "layer": 0, "ts": 0.0, "dur": 1.0}]) is None


def test_v10_batch_refuses_the_folded_merge_by_json_path() -> None:
    """A batch's schedule packs for v10 (attention per sequence); one that folds attn_reduce into o_proj is refused
    with the first such instruction's JSON path."""
    from megasynth.lowering.models import with_batch

    spec = with_batch(get_model("tiny"), 3)
    P.check_runs_batched_on_v10(P.pack(lower(spec, 6, Strategy(attn_splits=2)), "v10"))
    fused = lower(spec, 6, Strategy(attn_splits=2, fuse_attn_reduce=True))
    with pytest.raises(ScheduleError, match="only with 1 attention split") as info:
        P.check_runs_batched_on_v10(P.pack(fused, "v10"))
    at = next(i for i, ins in enumerate(fused.instructions) if ins.op == "attn_reduce_o_proj")
    assert info.value.path == f"$.instructions[{at}].args"
    # with one split the merge is o_proj's staging of the partials: a batch runs it
    P.check_runs_batched_on_v10(P.pack(lower(spec, 6, Strategy(attn_splits=1, fuse_attn_reduce=True)), "v10"))


def test_tensor_core_path_needs_k_ranges_on_64_column_boxes() -> None:
    """v10's batch-1 tensor-core path streams K in 64-column boxes from a range's start: tiny-qwen2's o_proj split
    in two at K 96 is refused, naming the instruction; llama-1b's K splits (multiples of 512) pass."""
    qwen2 = lower(get_model("tiny-qwen2"), 6, Strategy(k_splits={"o_proj_residual": 2}))
    with pytest.raises(ScheduleError, match="multiples of 64") as info:
        P.check_mma_k_starts(P.pack(qwen2, "v10"))
    at = next(i for i, ins in enumerate(qwen2.instructions)
              if ins.op == "o_proj_residual" and ins.args["k_start"] % 64)
    assert info.value.path == f"$.instructions[{at}].args"
    P.check_mma_k_starts(P.pack(lower(get_model("llama-1b"), 132, Strategy(k_splits={"o_proj_residual": 4,
                                                                                        "down_proj_residual": 4})),
                                "v10"))


def test_v10_needs_k_ranges_on_16_byte_columns() -> None:
    """v10's batch-1 build streams o_proj's and down's weights by TMA from a K range's first column, which must fall
    on 16 bytes (8 bf16 columns; 2 or 4 columns off faulted on the H200). The lowering's K splits pass, an odd split
    count's included (its parts are rounded up to whole 8 columns); a hand-written split moved 2 or 4 columns is
    refused, naming the first instruction; one moved 8 passes."""
    from tests.conftest import shift_k_splits

    cfg = get_model("tiny").config
    tiny = lower(get_model("tiny"), 6, Strategy(k_splits={"o_proj_residual": 2, "down_proj_residual": 2}))
    P.check_k_ranges(P.pack(tiny, "v10"), cfg)
    P.check_k_ranges(P.pack(shift_k_splits(tiny, "down_proj_residual", 8), "v10"), cfg)
    three = lower(get_model("llama-1b"), 132, Strategy(k_splits={"o_proj_residual": 3, "down_proj_residual": 3}))
    assert {ins.args["k_start"] for ins in three.instructions if ins.op == "down_proj_residual"} == {0, 2736, 5472}
    P.check_k_ranges(P.pack(three, "v10"), get_model("llama-1b").config)
    for op, by in (("down_proj_residual", 2), ("o_proj_residual", 4)):
        odd = shift_k_splits(tiny, op, by)
        bad = P.misaligned_k_ranges(P.pack(odd, "v10"), cfg)
        assert bad.sum() == sum(ins.op == op for ins in odd.instructions)  # each starts or ends on the moved boundary
        with pytest.raises(ScheduleError, match="multiple of 8 columns") as info:
            P.check_k_ranges(P.pack(odd, "v10"), cfg)
        at = next(i for i, ins in enumerate(odd.instructions) if ins.op == op)
        assert info.value.path == f"$.instructions[{at}].args"
