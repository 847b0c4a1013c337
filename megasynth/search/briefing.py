"""The agent's briefing: search context -> (system prompt, user message) within a measured token budget.

Everything the model is told is read from its owner: the model graph and op arguments from `megasynth.ir.catalogue`,
sizes from `lowering.models`, the strategy schema from `lowering.strategy.Strategy`, the patch language
from `lowering.patches`, timings from the best result's profile (GPU trace or cost-model timeline, labelled), and
the validator's counterexamples from the history. When the text is over budget, detail is dropped level by level
(fewer history rows, fewer layers in the id layout, shorter critical path) and the sizes are reported.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasynth.ir.catalogue import OP_ORDER, OPS, Geometry, footprint
from megasynth.ir.model import ModelConfig
from megasynth.ir.program import geometry_of
from megasynth.ir.schedule import Schedule
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.strategy import SearchSpace, Strategy, whole_head_qkv
from megasynth.runs.rundir import screened_text
from megasynth.search.proposers.base import Result, SearchContext

#: Detail levels tried in order until the briefing fits: history rows, counterexamples, layout layers shown
#: (the first ones and the last; the rest follow the same pattern, with the id/counter stride given),
#: critical-path segments, idle SMs listed, schema descriptions kept, counterexample chars.
LEVELS: list[dict[str, Any]] = [
    {"history": 20, "cex": 3, "layers": 3, "path": 48, "idle": 16, "descr": True, "cex_chars": 900},
    {"history": 12, "cex": 2, "layers": 2, "path": 32, "idle": 12, "descr": True, "cex_chars": 600},
    {"history": 6, "cex": 2, "layers": 2, "path": 20, "idle": 8, "descr": False, "cex_chars": 400},
    {"history": 3, "cex": 1, "layers": 1, "path": 12, "idle": 4, "descr": False, "cex_chars": 300},
]

#: Sections dropped whole, in this order, when the most compact level is still over budget (the best's profile,
#: the counterexamples and the schemas needed to answer stay).
DROP_ORDER = ["layout", "model", "history", "hardware"]

DEFAULT_BUDGET = 8000  # tokens for system + user; small enough for an 8k-context local model with room to answer


def count_tokens(text: str) -> int:
    """Token count: tiktoken's cl100k when it is installed, else the chars/4 estimate."""
    try:
        import tiktoken  # type: ignore[import-not-found]

        return len(tiktoken.get_encoding("cl100k_base").encode(text))
    except Exception:  # noqa: BLE001 - not installed, or its encoding file cannot be fetched offline
        return (len(text) + 3) // 4


@dataclass
class Briefing:
    """One request's text and its measured size (tokens per section, the level of detail that fitted)."""

    system: str
    user: str
    sections: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    budget: int = DEFAULT_BUDGET
    level: int = 0
    truncated: bool = False

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


SYSTEM = """You tune megakernel schedules for one LLM decode step on a GPU.
A schedule is a list of instructions (catalogue ops on tiles) placed in per-SM queues: worker w runs queues[w] in
order. Before starting, an instruction waits until counters[c] >= value for each of its waits; after its writes it
adds to counters (signals). Its meaning is running all instructions one at a time in ascending id order, so every
pair that touches one buffer region (not both reads, not both reduces) must stay ordered by queue order or by
counters in every interleaving. A static validator proves this for every proposal: racy or deadlocking ones are
rejected and you are shown the counterexample. Accepted ones are timed (GPU) or estimated (cost model, labelled).
Goal: lower the time per decode step. Levers: strategy knobs (tiles, splits, assignment ...) and explicit patches
(move instructions between queues, add/change/remove waits and signals). Drop a wait only when another ordering
makes it redundant. Change a few things per proposal, learn from the history, do not repeat a rejected idea.
Answer with ONE JSON object and nothing else:
{"strategy": {<only the knobs you change, same shape as the strategy schema; merged onto the best strategy>},
 "patches": [<patch objects, applied in order to the schedule lowered from the merged strategy; may be empty>],
 "rationale": "<one line: what you changed and why it should be faster>"}"""


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=False)


def _strip_schema(schema: Any, descr: bool) -> Any:
    """Drop titles (and descriptions when asked) from a JSON schema: noise for the model, tokens for us."""
    if isinstance(schema, dict):
        return {k: _strip_schema(v, descr) for k, v in schema.items()
                if k != "title" and (descr or k != "description")}
    if isinstance(schema, list):
        return [_strip_schema(v, descr) for v in schema]
    return schema


def patch_language(descr: bool = True) -> str:
    """The patch language as `megasynth.lowering.patches` defines it: its docstring and one line per patch kind, derived
    from its JSON schema (`{"op":"move","id":int,...}  meaning`), or a note when the module is absent."""
    try:
        import megasynth.lowering.patches as patches
    except ModuleNotFoundError:
        return "Patches are not available in this build: leave \"patches\" empty."
    parts = [(patches.__doc__ or "").strip()]
    schema = patch_schema()
    if schema is not None:
        kinds = list(schema.get("$defs", {}).values()) or [schema]
        for kind in kinds:
            fields = []
            for name, prop in kind.get("properties", {}).items():
                const = prop.get("const") or (prop.get("enum") or [None])[0] if name == "op" else None
                if const is not None:
                    fields.append(f'"{name}":"{const}"')
                    continue
                types = [t.get("type", "?") for t in prop.get("anyOf", [])] or [prop.get("type", "?")]
                text = "|".join("int" if t == "integer" else t for t in types)
                lo, hi = prop.get("minimum"), prop.get("maximum")
                for t in prop.get("anyOf", []):
                    lo, hi = t.get("minimum", lo), t.get("maximum", hi)
                if lo is not None and lo > 0:
                    text += f">={lo}"
                optional = name not in kind.get("required", [])
                fields.append(f'"{name}":{text}' + (f" (default {prop.get('default')})" if optional else ""))
            line = "{" + ",".join(fields) + "}"
            if descr and kind.get("description"):
                line += "  " + " ".join(kind["description"].split())
            parts.append("- " + line)
    return "\n".join(p for p in parts if p)


def patch_schema() -> dict[str, Any] | None:
    """The JSON schema of one patch, from `megasynth.lowering.patches` (a `PATCH_SCHEMA` dict, `patch_schema()`, or a
    pydantic `Patch` model), or None when that module does not publish one."""
    try:
        import megasynth.lowering.patches as patches
    except ModuleNotFoundError:
        return None
    for name in ("patch_schema", "PATCH_SCHEMA", "Patch"):
        obj = getattr(patches, name, None)
        if obj is None:
            continue
        if isinstance(obj, dict):
            return obj
        if hasattr(obj, "model_json_schema"):
            return obj.model_json_schema()
        if callable(obj):
            return obj()
    try:
        from pydantic import TypeAdapter

        adapter = getattr(patches, "PatchAdapter", None) or TypeAdapter(patches.PatchModel)  # type: ignore[attr-defined]
        return adapter.json_schema()
    except Exception:  # noqa: BLE001 - the module publishes no schema; the docstring alone describes patches
        return None


# ----------------------------------------------------------------------------------------------------------------
# Sections


def _features(c: ModelConfig) -> list[str]:
    """One line on what the model adds to Llama (none for a Llama): what attn_norm_qkv_rope computes and which of its
    tiles are legal."""
    parts = []
    if c.qkv_bias:
        parts.append("qkv_bias: attn_norm_qkv_rope adds a bias to its q, k and v rows (no constraint on tiles)")
    if c.qk_norm:
        qk_end = c.q_size + c.kv_size
        parts.append(f"qk_norm: RMSNorm over each q and k head before RoPE. With the strategy's qk_norm 'in_qkv' "
                     f"the norm is inside attn_norm_qkv_rope, whose tiles hold whole q and k heads: start/end below "
                     f"{qk_end} (the end of the k rows) are multiples of head_dim {c.hd}; v rows may still be cut "
                     f"into RoPE pairs; a tile that cuts a q or k head is rejected. With 'apart', "
                     f"attn_norm_qkv_rope_sq takes tiles of any RoPE pairs and one qk_norm_apply per KV head scales "
                     f"its q heads and writes its k row before attention (more SMs on QKV, one counter hop more). "
                     f"With 'in_attention', the same QKV tiles, and attention normalises its q heads and the new k "
                     f"row itself (attn_partial qk_norm 1); qk_norm_apply (k_only 1) writes the k row into the cache "
                     f"after the layer's attention, off the chain (no hop more)")
    return ["Model features: " + "; ".join(parts) + "."] if parts else []


def _batch_lines(spec: ModelSpec) -> list[str]:
    """What a batch changes for the schedule (none at batch 1)."""
    if spec.batch == 1:
        return ["Batch: one sequence per step."]
    if whole_head_qkv(spec):
        runs = (f"It runs on interpreter v9: QKV tiles of whole heads (multiples of head_dim {spec.config.hd}), "
                f"fuse_attn_reduce false, qk_norm in_qkv.")
    else:
        runs = ("It runs on interpreter v10: QKV tiles of RoPE pairs as at batch 1, fuse_attn_reduce only with "
                "attn_splits 1 (o_proj then stages that split's output; a merge of more splits is refused); from "
                "batch 8 a ring slot is a tile of 128 weight rows (gate/up: 64 gate and 64 up rows), so o_proj and "
                "down tiles of 128 rows and gate/up tiles of multiples of 64 fill it."
                + (" A QK-norm model's batch applies the norm apart or inside attention (qk_norm 'auto': inside "
                   "attention)." if spec.config.qk_norm else ""))
    return [f"Batch: {spec.batch} sequences per step, each at its own position (attn_partial and attn_reduce "
            f"instructions carry `seq`; weight ops serve every sequence, each weight tile read once per "
            f"instruction). {runs} Each weight instruction stages its K x {spec.batch} activations before "
            f"streaming its rows, so instructions of many rows pay (llama-1b at batch 8 on an H200: 1.215 ms with "
            f"64-row o_proj and down instructions, 1.090 with 128-row ones, on an earlier build). On the current "
            f"build, llama-1b at batch 8: one attention split folded into o_proj 0.831 ms against two splits with "
            f"the merge apart 0.856; QKV tiles of 32 rows (96 instructions) 0.850 against 64 rows (48) 0.862; "
            f"waits per KV head between QKV, attention, its merge and o_proj instead of per stage measured slower "
            f"(1.010 ms against 0.972 on an earlier build). Down and o_proj stage bf16 activations, QKV and gate/up "
            f"stage x (fp16 from batch 8) with its norm: every SM of their phase reads all of it."]


def _model_section(spec: ModelSpec, schedule: Schedule | None, seq: int) -> str:
    """Model sizes, the op graph (reads/writes per op, from catalogue footprints) and per-op bytes/flops."""
    c = spec.config
    lines = [f"## Model: {spec.name} ({spec.description})",
             f"hidden {c.hidden_size}, intermediate {c.intermediate_size}, layers {c.num_hidden_layers}, "
             f"heads {c.num_attention_heads}, kv heads {c.num_key_value_heads}, head_dim {c.hd}, "
             f"vocab {c.vocab_size}, max_seq_len {spec.max_seq_len}; timings below are at sequence length {seq}.",
             *_features(c), *_batch_lines(spec),
             "Decode order: " + " -> ".join(op if not OPS[op].layered else f"{op}[L]" for op in OP_ORDER)
             + f" (ops marked [L] repeat per layer, L = 0..{c.num_hidden_layers - 1}).",
             "Ops (args are integers; reads/writes name activation buffers; weights are read-only):"]
    geo = geometry_of(schedule) if schedule is not None else Geometry(c, spec.max_seq_len)
    per_op: dict[str, list[Any]] = {}
    if schedule is not None and geo is not None:
        for ins in schedule.instructions:
            if ins.op not in OPS:
                continue
            layer = ins.layer if ins.layer is not None else -1
            nbytes, flops = OPS[ins.op].cost(geo, layer, ins.args, min(seq, spec.max_seq_len))
            rec = per_op.setdefault(ins.op, [0, 0, 0, None])
            rec[0] += 1
            rec[1] += nbytes
            rec[2] += flops
            if rec[3] is None:
                rec[3] = footprint(geo, ins.op, layer, ins.args)
    total_bytes = sum(r[1] for r in per_op.values()) or 1
    for op in OP_ORDER:
        spec_op = OPS[op]
        args = ", ".join(f"{k}: {v}" for k, v in spec_op.args.items())
        line = f"- {op}: {spec_op.summary}. args {{{args}}}"
        rec = per_op.get(op)
        if rec is not None:
            reads = sorted({a[1] for a in rec[3] if a[0] == "read"})
            writes = sorted({a[1] + (" (reduce-add)" if a[0] == "reduce" else "") for a in rec[3] if a[0] != "read"})
            per = c.num_hidden_layers if spec_op.layered else 1
            line += (f". reads {','.join(reads) or '-'}; writes {','.join(writes)}. In the best schedule: "
                     f"{rec[0] // per} instr{'/layer' if spec_op.layered else ''}, {rec[1] / per / 1e6:.3g} MB and "
                     f"{rec[2] / per / 1e6:.3g} MFLOP{'/layer' if spec_op.layered else ''} "
                     f"({100 * rec[1] / total_bytes:.0f}% of all bytes)")
        lines.append(line)
    if per_op:
        lines.append(f"Total per step: {total_bytes / 1e6:.4g} MB moved.")
    return "\n".join(lines)


def _hardware_section(ctx: SearchContext, schedule: Schedule | None) -> str:
    target = schedule.target.device if schedule is not None and schedule.target.device else None
    where = f"target {target}, timed by {ctx.device}" if target and target != ctx.device else ctx.device
    lines = [f"## Hardware: {where}; {ctx.workers} workers (one persistent program per SM)"]
    try:
        from megasynth.lowering.costmodel import load_params  # the cost model owns the hardware numbers

        p = load_params()
        lines.append(f"Device memory bandwidth {p.total_bw / 1e6:.2f} TB/s in all, up to {p.sm_peak / 1e6:.3f} TB/s "
                     f"for one SM; an inter-SM signal (counter hop) costs {p.hop_us:.2f} us; "
                     f"cost-model parameters: {p.source}.")
    except (ImportError, OSError, ValueError, TypeError):
        pass
    lines.append("Times are " + ("cost-model ESTIMATES (no GPU here)" if ctx.estimated else "measured on the GPU")
                 + ".")
    return "\n".join(lines)


def _strategy_section(best: Result | None, descr: bool, space: SearchSpace | None = None) -> str:
    schema = _strip_schema(Strategy.model_json_schema(), descr)
    current = best.proposal.strategy if best is not None else Strategy()
    lines = ["## Strategy (JSON schema; your \"strategy\" holds only the knobs you change)", _compact(schema),
             "Best strategy so far: " + _compact(current.model_dump(mode="json"))]
    if space is not None:  # the values the built-in search tries for this model and SM count (others are allowed)
        lines.append("Searched values per knob (edges.E sets edges[E] and, for chunk:N, chunks[E] = N):")
        lines += [f"- {k.name}: {_compact(list(k.choices))}" + (f" ({k.why})" if descr else "") for k in space.knobs]
    default = Strategy().model_dump(mode="json")
    if current.model_dump(mode="json") != default:
        lines.append("Default (naive baseline) strategy: " + _compact(default))
    if best is not None and best.proposal.patches:
        lines.append(f"Best schedule's patches ({len(best.proposal.patches)}; NOT inherited — repeat the ones you "
                     f"want): " + _compact(best.proposal.patches[:20]))
    return "\n".join(lines)


def _layout_section(schedule: Schedule, layers: int | None) -> str:
    """The best schedule's instruction ids grouped by (op, layer): id range, waits, signals, workers."""
    where = {}
    for w, q in enumerate(schedule.queues):
        for p, ident in enumerate(q):
            where[ident] = (w, p)
    groups: list[dict[str, Any]] = []
    for ins in sorted(schedule.instructions, key=lambda i: i.id):
        key = (ins.op, ins.layer)
        if not groups or groups[-1]["key"] != key:
            groups.append({"key": key, "ids": [], "waits": Counter(), "signals": Counter(), "workers": set()})
        g = groups[-1]
        g["ids"].append(ins.id)
        g["waits"].update(f"c{w.counter}>={w.value}" for w in ins.waits)
        g["signals"].update(f"c{s.counter}+{s.add}" for s in ins.signals)
        g["workers"].add(where.get(ins.id, (-1, -1))[0])
    n_layers = 1 + max((g["key"][1] for g in groups if g["key"][1] is not None), default=-1)
    shown = set(range(n_layers)) if layers is None or layers >= n_layers else \
        set(range(max(1, layers - 1))) | {n_layers - 1}
    lines = [f"## Best schedule layout: {len(schedule.instructions)} instructions, {schedule.counters} counters, "
             f"{len(schedule.queues)} queues. Rows: op layer: ids first..last (count); waits; signals; workers.",
             "(Ids and counters change when tiles/splits change; patches refer to the schedule lowered from YOUR "
             "strategy, which equals this one when you change no lowering knob.)"]
    skipped = []

    def fmt(counter: Counter, n: int) -> str:
        items = [f"{k}" + ("" if v == n else f" (x{v})") for k, v in counter.most_common(4)]
        more = len(counter) - 4
        return ",".join(items) + (f",+{more} more" if more > 0 else "") if items else "-"

    for g in groups:
        op, layer = g["key"]
        if layer is not None and layer not in shown:
            if not skipped or skipped[-1] != layer:
                skipped.append(layer)
            continue
        ids, workers = g["ids"], sorted(g["workers"])
        contiguous = ids[-1] - ids[0] + 1 == len(ids)
        span = f"{ids[0]}..{ids[-1]}" + ("" if contiguous else " (gaps)")
        wtxt = f"{workers[0]}..{workers[-1]}" if len(workers) > 3 else ",".join(map(str, workers))
        lines.append(f"{op} {'L' + str(layer) if layer is not None else '-'}: {span} ({len(ids)}); "
                     f"waits {fmt(g['waits'], len(ids))}; signals {fmt(g['signals'], len(ids))}; "
                     f"{len(workers)} workers {wtxt}")
    if skipped:
        lines.append(f"(layers {skipped[0]}..{skipped[-1]} omitted: same pattern{_stride(groups)})")
    return "\n".join(lines)


def _stride(groups: list[dict[str, Any]]) -> str:
    """`, ids +856 and counters +6 per layer` when every op's first id and first signalled counter shift evenly."""
    first: dict[tuple[str, int], tuple[int, int | None]] = {}
    for g in groups:
        op, layer = g["key"]
        if layer is not None:
            sig = min((int(k[1:].split("+")[0]) for k in g["signals"]), default=None)
            first[(op, layer)] = (g["ids"][0], sig)
    id_steps, ctr_steps = set(), set()
    for (op, layer), (ident, sig) in first.items():
        prev = first.get((op, layer - 1))
        if prev is not None:
            id_steps.add(ident - prev[0])
            if sig is not None and prev[1] is not None:
                ctr_steps.add(sig - prev[1])
    if len(id_steps) != 1:
        return "; ids and counters shift per layer"
    text = f", ids +{id_steps.pop()}"
    if len(ctr_steps) == 1:
        text += f" and signalled counters +{ctr_steps.pop()}"
    return text + " per layer"


def _first(d: dict[str, Any], *names: str) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return None


def _label(item: Any) -> str:
    if isinstance(item, dict):
        op = item.get("op") or item.get("name") or "?"
        layer = item.get("layer")
        ident = item.get("id")
        return f"{op}" + (f" L{layer}" if layer is not None else "") + (f"#{ident}" if ident is not None else "")
    return str(item)


def _path_runs(path: list[Any], limit: int) -> str:
    """A critical path as runs of consecutive steps with the same op+layer (`mlp_norm_gate_up L0#332..728 (x4)`);
    consecutive layers whose runs follow the same op pattern are folded into one line with layer 0's ids."""
    runs: list[list[Any]] = []  # [op, layer, count, first label, last label]
    for item in path:
        op, layer = (item.get("op"), item.get("layer")) if isinstance(item, dict) else (str(item), None)
        label = _label(item)
        if runs and runs[-1][0] == op and runs[-1][1] == layer:
            runs[-1][2] += 1
            runs[-1][4] = label
        else:
            runs.append([op, layer, 1, label, label])

    def text(r: list[Any]) -> str:
        return r[3] + (f"..{r[4].split('#')[-1]} (x{r[2]})" if r[2] > 1 else "")

    # Fold: blocks of runs per layer (None layers stand alone), equal op patterns merged.
    blocks: list[tuple[Any, list[list[Any]]]] = []
    for r in runs:
        if blocks and r[1] is not None and blocks[-1][0] == r[1]:
            blocks[-1][1].append(r)
        else:
            blocks.append((r[1], [r]))
    out: list[str] = []
    k = 0
    while k < len(blocks):
        layer, block = blocks[k]
        pattern = [(r[0], r[2]) for r in block]
        j = k + 1
        while layer is not None and j < len(blocks) and blocks[j][0] is not None and \
                [(r[0], r[2]) for r in blocks[j][1]] == pattern:
            j += 1
        if j - k > 1:
            out.append(f"[layers {layer}..{blocks[j - 1][0]}, each: " + " -> ".join(
                f"{op}" + (f" (x{n})" if n > 1 else "") for op, n in pattern) + "; layer "
                f"{layer} ids: " + ", ".join(text(r).split(" ", 1)[-1] if r[1] is not None else text(r)
                                             for r in block) + "]")
        else:
            out.extend(text(r) for r in block)
        k = j
    more = len(out) - limit
    return " -> ".join(out[:limit]) + (f" -> ... {more} more segments" if more > 0 else "")


def normalise_profile(profile: dict[str, Any] | None, schedule: Schedule | None, seq: int,
                      estimated: bool) -> dict[str, Any]:
    """Per-op busy time, per-SM idle (µs) and the critical path (labelled ids) from a result's profile, a GPU
    trace in the shared format, or — for what is missing — the cost model's timeline of `schedule` (labelled)."""
    prof = dict(profile or {})
    out: dict[str, Any] = {"source": "GPU trace" if not estimated else "cost model (estimated)"}
    trace = prof.get("trace") or prof.get("trace_path")
    if isinstance(trace, str | Path) or (isinstance(trace, dict) and "traceEvents" in trace):
        try:
            from megasynth.trace import read_trace, summarize

            summary = summarize(read_trace(trace) if isinstance(trace, str | Path) else trace)
            prof = {**summary, **prof}
            out["source"] = "cost model trace (estimated)" if summary.get("estimated") else "GPU trace"
        except (ImportError, OSError, TypeError, ValueError, KeyError):
            pass
    per_op = _first(prof, "per_op_us", "time_per_op_us")
    if per_op is None and isinstance(_first(prof, "per_op_ms"), dict):
        per_op = {k: 1000 * float(v) for k, v in prof["per_op_ms"].items()}
    if per_op is None and isinstance(prof.get("per_op"), dict):  # megasynth.trace.summarize
        per_op = {k: float(v.get("total_us", 0.0)) if isinstance(v, dict) else float(v)
                  for k, v in prof["per_op"].items()}
    idle = _first(prof, "per_sm_idle_us", "idle_us")
    if idle is None and isinstance(_first(prof, "per_sm_idle_ms"), list | dict):
        raw = prof["per_sm_idle_ms"]
        idle = [1000 * float(v) for v in raw] if isinstance(raw, list) else {k: 1000 * float(v) for k, v in raw.items()}
    per_sm = prof.get("per_sm")
    if isinstance(per_sm, dict) and per_sm and all(isinstance(v, dict) for v in per_sm.values()):
        if idle is None:
            idle = {k: float(v.get("idle_us", 0.0)) for k, v in per_sm.items()}
        out["wait_us"] = {int(k) if str(k).isdigit() else k: float(v.get("wait_us", 0.0)) for k, v in per_sm.items()}
    path = _first(prof, "critical_path")
    if isinstance(path, dict):
        path = _first(path, "instructions", "ids", "path")
    if (not isinstance(per_op, dict) or not isinstance(idle, list | dict) or not isinstance(path, list)) \
            and schedule is not None:
        try:
            from megasynth.lowering.costmodel import estimate

            est = estimate(schedule, seq)
            per_op = per_op if isinstance(per_op, dict) else {k: 1000 * v for k, v in est.per_op_ms.items()}
            idle = idle if isinstance(idle, list | dict) else [1000 * v for v in est.per_sm_idle_ms]
            path = path if isinstance(path, list) else est.critical_path
            out["source"] += "; missing parts from the cost model (estimated)" if not estimated else ""
        except Exception as exc:  # noqa: BLE001 - the briefing goes on without a timeline; say why
            out["error"] = f"no timeline: {type(exc).__name__}: {exc}"[:200]
    if isinstance(per_op, dict):
        out["per_op_us"] = {str(k): float(v) for k, v in per_op.items()}
    if isinstance(idle, list):
        out["idle_us"] = {w: float(v) for w, v in enumerate(idle)}
    elif isinstance(idle, dict):
        out["idle_us"] = {int(k) if str(k).isdigit() else k: float(v) for k, v in idle.items()}
    if isinstance(path, list):
        info = {ins.id: ins for ins in schedule.instructions} if schedule is not None else {}
        labelled = []
        for item in path:
            ins = info.get(item) if isinstance(item, int) else None
            labelled.append({"id": item, "op": ins.op, "layer": ins.layer} if ins is not None else item)
        out["critical_path"] = labelled
    return out


def _sm_groups(per_sm: dict[Any, float], groups: int) -> str:
    """The SMs with the largest values, grouped by value (0.1 us) with runs of SM numbers: `30.5 SM84-99,SM80`."""
    by_value: dict[float, list[Any]] = {}
    for w, v in per_sm.items():
        by_value.setdefault(round(v, 1), []).append(w)
    out = []
    for value in sorted(by_value, reverse=True)[:groups]:
        sms = sorted(by_value[value], key=lambda w: (not isinstance(w, int), w if isinstance(w, int) else 0))
        runs: list[list[Any]] = []
        for w in sms:
            if runs and isinstance(w, int) and isinstance(runs[-1][1], int) and w == runs[-1][1] + 1:
                runs[-1][1] = w
            else:
                runs.append([w, w])
        text = ",".join(f"SM{a}" + (f"-{b}" if b != a else "") for a, b in runs[:8])
        if len(runs) > 8:
            text += f",+{sum(1 for _ in runs[8:])} more runs"
        out.append(f"{value:.1f} {text}")
    return "; ".join(out)


def _best_section(ctx: SearchContext, prof: dict[str, Any], level: dict[str, Any]) -> str:
    best = ctx.best
    if best is None:
        return "## Best so far: none evaluated yet."
    label = "estimated by the cost model" if best.estimated else "measured on the GPU"
    lines = [f"## Best so far: candidate {best.candidate} ({best.proposal.proposer or '?'}): "
             f"{best.ms:.4f} ms per step, {label}" if best.ms is not None else
             f"## Best so far: candidate {best.candidate}, no time"]
    if ctx.baseline_ms and best.ms:
        lines.append(f"Naive baseline: {ctx.baseline_ms:.4f} ms; speed-up {ctx.baseline_ms / best.ms:.3f}x.")
    lines.append(f"Profile source: {prof.get('source')}" + (f" ({prof['error']})" if prof.get("error") else ""))
    per_op = prof.get("per_op_us") or {}
    if per_op:
        total = sum(per_op.values()) or 1.0
        lines.append("Busy time per op, summed over SMs: " + ", ".join(
            f"{op} {us:.1f}us ({100 * us / total:.0f}%)" for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])))
    idle = prof.get("idle_us") or {}
    if idle:
        vals = sorted(idle.values())
        lines.append(f"Idle per SM (us): min {vals[0]:.1f}, median {vals[len(vals) // 2]:.1f}, max {vals[-1]:.1f}; "
                     "most idle: " + _sm_groups(idle, max(2, level["idle"] // 3)))
    waiting = prof.get("wait_us") or {}
    if waiting and any(waiting.values()):
        vals = sorted(waiting.values())
        lines.append(f"Spin-waiting on counters per SM (us): median {vals[len(vals) // 2]:.1f}, max {vals[-1]:.1f}; "
                     "most waiting: " + _sm_groups(waiting, max(2, level["idle"] // 3)))
    path = prof.get("critical_path") or []
    if path:
        lines.append(f"Critical path ({len(path)} instructions, first to last): {_path_runs(path, level['path'])}")
    return "\n".join(lines)


def _strategy_diff(strategy: Strategy, base: dict[str, Any]) -> str:
    cur = strategy.model_dump(mode="json")
    diff: dict[str, Any] = {}
    for k, v in cur.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            sub = {kk: vv for kk, vv in v.items() if base[k].get(kk) != vv}
            if sub:
                diff[k] = sub
        elif base.get(k) != v:
            diff[k] = v
    return _compact(diff) if diff else "default"


def _history_section(history: list[Result], rows: int) -> str:
    if not history:
        return "## History: nothing evaluated yet."
    base = Strategy().model_dump(mode="json")
    shown = history[-rows:]
    lines = [f"## History (last {len(shown)} of {len(history)}; strategy shown as its difference from the default)"]
    for r in shown:
        if r.accepted:
            verdict = f"accepted {r.ms:.4f} ms" + (" est" if r.estimated else "") if r.ms is not None else "accepted"
        elif r.screened is not None:
            verdict = screened_text(r.screened) + ": not validated or timed, the cost model rates it far behind"
        elif r.error:
            verdict = "not accepted (not validated): " + r.error[:160]
        else:
            cat = _cex_categories(r.counterexample)
            verdict = "REJECTED by the validator" + (f" ({cat})" if cat else "")
        diff = _strategy_diff(r.proposal.strategy, base)
        lines.append(f"- {r.candidate} [{r.proposal.proposer or '?'}] strategy {diff}"
                     f"{f'; {len(r.proposal.patches)} patches' if r.proposal.patches else ''}: {verdict}"
                     + (f" — \"{r.proposal.rationale[:120]}\"" if r.proposal.rationale else ""))
    return "\n".join(lines)


def _findings(cex: Any) -> list[dict[str, Any]]:
    if isinstance(cex, dict):
        if isinstance(cex.get("findings"), list):
            return [f for f in cex["findings"] if isinstance(f, dict)]
        return [cex]
    if isinstance(cex, list):
        return [f for f in cex if isinstance(f, dict)]
    return []


def _event_text(e: Any) -> str:
    if not isinstance(e, dict):
        return str(e)
    text = f"{e.get('n', '')}. w{e.get('worker', '?')} {e.get('event', '?')} #{e.get('instruction', '?')}"
    if e.get("op"):
        text += f" {e['op']}" + (f" L{e['layer']}" if e.get("layer") is not None else "")
    if e.get("waits"):
        text += " (waits " + ",".join(f"c{w.get('counter')}>={w.get('value')}" for w in e["waits"]
                                      if isinstance(w, dict)) + ")"
    if e.get("counters"):
        text += " -> " + ",".join(f"c{k}={v}" for k, v in e["counters"].items())
    return text


def _compact_events(events: list[Any], involved: set[Any], keep_last: int = 6) -> str:
    """The events that touch the conflicting instructions plus the last few, in order; the rest elided."""
    keep = {k for k, e in enumerate(events) if isinstance(e, dict) and e.get("instruction") in involved}
    keep |= set(range(max(0, len(events) - keep_last), len(events)))
    parts, skipped = [], 0
    for k, e in enumerate(events):
        if k in keep:
            if skipped:
                parts.append(f"({skipped} events)")
                skipped = 0
            parts.append(_event_text(e))
        else:
            skipped += 1
    return "; ".join(parts)


def _cex_categories(cex: Any) -> str:
    return ", ".join(sorted({str(f.get("category", "?")) for f in _findings(cex)}))


def compact_counterexample(cex: Any, chars: int = 900) -> str:
    """A validator counterexample in a few lines: category, message, instructions, the first interleaving events."""
    out = []
    for f in _findings(cex)[:3]:
        line = f"{f.get('category', '?')}: {str(f.get('message', ''))}"
        ids = f.get("instructions") or []
        if ids:
            line += f" [instructions {ids[:12]}{'...' if len(ids) > 12 else ''}]"
        details = f.get("details") or {}
        events = None
        if isinstance(details, dict):
            events = _first(details, "events", "interleaving", "trace", "witness")
            if isinstance(events, dict):
                events = _first(events, "events", "steps")
        if isinstance(events, list) and events:
            line += " interleaving: " + _compact_events(events, set(ids) | set(details.get("pair") or []))
        out.append(line)
    if not out and cex is not None:
        out.append(_compact(cex))
    text = "\n".join(out)
    return text if len(text) <= chars else text[: chars - 15] + " ...[truncated]"


def _cex_section(history: list[Result], count: int, chars: int) -> str:
    rejected = [r for r in history if not r.accepted and (r.counterexample is not None or r.error)][-count:]
    if not rejected:
        return ""
    lines = ["## Validator counterexamples for the latest rejected proposals (do not repeat these mistakes)"]
    for r in rejected:
        head = f"- {r.candidate} [{r.proposal.proposer or '?'}]"
        if r.proposal.patches:
            head += " patches " + _compact(r.proposal.patches[:6])[:300]
        lines.append(head)
        lines.append("  " + (compact_counterexample(r.counterexample, chars) if r.counterexample is not None
                             else "error: " + str(r.error)[:chars]).replace("\n", "\n  "))
    return "\n".join(lines)


def build_briefing(ctx: SearchContext, spec: ModelSpec, best_schedule: Schedule | None, *,
                   budget: int = DEFAULT_BUDGET, seq: int = 1024, notes: list[str] | None = None,
                   profile: dict[str, Any] | None = None) -> Briefing:
    """Build the request for one round, dropping detail level by level until it fits `budget` tokens.
    `profile` is the best's `normalise_profile` when the caller has it cached (else it is computed here)."""
    system = SYSTEM
    sys_tokens = count_tokens(system)
    seq = max(1, min(seq, spec.max_seq_len))
    if profile is not None:
        prof = profile
    else:
        prof = normalise_profile(ctx.best.profile, best_schedule, seq, ctx.best.estimated) if ctx.best else {}
    for lvl, level in enumerate(LEVELS):
        sections = {
            "model": _model_section(spec, best_schedule, seq),
            "hardware": _hardware_section(ctx, best_schedule),
            "strategy": _strategy_section(ctx.best, level["descr"], SearchSpace(spec, ctx.workers)),
            "patches": "## Patch language\n" + patch_language(level["descr"]),
            "layout": _layout_section(best_schedule, level["layers"]) if best_schedule is not None else "",
            "best": _best_section(ctx, prof, level),
            "history": _history_section(ctx.history, level["history"]),
            "counterexamples": _cex_section(ctx.history, level["cex"], level["cex_chars"]),
            "notes": ("## Notes from your previous rounds\n" + "\n".join(f"- {n}" for n in notes[-5:])) if notes
            else "",
        }
        sections = {k: v for k, v in sections.items() if v}
        user = "\n\n".join(sections.values()) + "\n\nPropose one schedule change now, as the JSON object described."
        sizes = {"system": sys_tokens, **{k: count_tokens(v) for k, v in sections.items()}}
        total = sys_tokens + count_tokens(user)
        if total <= budget or lvl == len(LEVELS) - 1:
            truncated = False
            for name in DROP_ORDER:  # last level still too big: drop the least useful sections whole
                if total <= budget:
                    break
                if name in sections:
                    sections[name] = f"## {name}: omitted to fit the token budget"
                    user = "\n\n".join(sections.values()) + \
                        "\n\nPropose one schedule change now, as the JSON object described."
                    sizes[name] = count_tokens(sections[name])
                    total = sys_tokens + count_tokens(user)
            if total > budget:
                keep = max(0, (budget - sys_tokens) * 4 - 200)
                user = user[:keep] + "\n...[briefing truncated to fit the token budget]\nAnswer with the JSON object."
                truncated = True
                total = sys_tokens + count_tokens(user)
            return Briefing(system, user, sizes, total, budget, lvl, truncated)
    raise AssertionError("unreachable: the last level always returns")


def main(argv: list[str] | None = None) -> int:
    """`python -m search.briefing --model llama-1b`: print the first round's briefing (naive baseline as the best,
    estimated) and its measured size per section, to check that it fits a model's context before a run."""
    import argparse
    import sys

    from megasynth.lowering.lower import lower
    from megasynth.lowering.models import get_model, with_batch
    from megasynth.search.proposers.base import Proposal

    parser = argparse.ArgumentParser(prog="python -m megasynth.search.briefing", description=main.__doc__)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--workers", type=int, default=132)
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (1-16)")
    args = parser.parse_args(argv)
    try:
        spec = with_batch(get_model(args.model), args.batch)
    except (KeyError, ValueError) as exc:  # an unknown model, a batch out of range
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    if not 1 <= args.workers <= 4096 or args.budget < 500:
        print("error: --workers must be in [1, 4096] and --budget at least 500", file=sys.stderr)
        return 2
    from megasynth.lowering.costmodel import estimate

    schedule = lower(spec, args.workers)
    est = estimate(schedule, min(args.ctx, spec.max_seq_len))
    best = Result("c0000", Proposal(Strategy(), proposer="naive"), True, est.makespan_ms, True,
                  profile={"trace": est.trace})
    ctx = SearchContext(spec.name, args.workers, "cost model (CPU)", best, [best], est.makespan_ms, True)
    b = build_briefing(ctx, spec, schedule, budget=args.budget, seq=args.ctx)
    print(b.system + "\n\n" + b.user)
    print(f"\n{b.tokens} tokens (budget {b.budget}, detail level {b.level}{', truncated' if b.truncated else ''}): "
          + ", ".join(f"{k} {v}" for k, v in b.sections.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
