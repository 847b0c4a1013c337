"""The `synth bench` result as rich tables that fit 80 columns: one per ctx (median, spread, ratios against the best
PyTorch step and the floor, the check against the reference; at a batch > 1 also tokens/s), then one line per
variant on how it is launched or why it did not run."""

from __future__ import annotations

from typing import Any

from megasynth.measure.torch_step import CHECK_TOL, PYTORCH_TOL, check_ok

SHORT = {"torch_eager": "torch eager", "torch_graph": "torch graph", "torch_bf16": "torch bf16",
         "hf_eager": "HF eager", "torch_compile": "torch.compile", "per_op_graph": "per-op graph",
         "megakernel": "megakernel", "cpu_executor": "CPU executor"}

LEGEND = ("ms = median; vs PT = the best PyTorch step's time (*) / this time; x floor = this time / floor; "
          "% copy = floor / this time (the floor moves the step's bytes at the measured copy bandwidth); "
          f"err = relative L2 error of the logits against the fp32 reference (green <= {CHECK_TOL:g}; yellow <= "
          f"{PYTORCH_TOL:g}, bf16 rounding; argmax: the greedy token differs)")
BATCH_LEGEND = ("; at a batch, tok/s = the batch's tokens per second (batch / ms) in place of % copy, err = the "
                "worst sequence's, argmax = a sequence's greedy token differs beyond a near-tie")


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _colour(check: dict[str, Any]) -> str:
    return "green" if check_ok(check) else "yellow" if check_ok(check, PYTORCH_TOL) else "red"


def render(result: dict[str, Any]) -> list[Any]:
    """Rich renderables: per ctx a table and its notes, then the legend."""
    from rich import box
    from rich.table import Table

    out: list[Any] = []
    copy = result["copy_bandwidth"]["tbps"]
    batched = False
    for rec in result["results"]:
        floor = rec["floor"]
        best = (rec.get("pytorch_best") or {}).get("variant")
        batch = rec.get("batch", 1)
        batched |= batch > 1
        title = (f"{result['model']}, ctx {rec['ctx']}{f', batch {batch}' if batch > 1 else ''}, "
                 f"{result['device']['name']}"
                 f"{' (DRY RUN on the CPU)' if result['dry_run'] else ''}\nfloor {floor['ms']:.3f} ms = "
                 f"{floor['bytes']['total'] / 1e9:.3f} GB at {copy:.2f} TB/s copy")
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True)
        # at a batch, tok/s takes the place of % copy (100 / x floor), so that the table still fits 80 columns
        cols = ("variant", "ms", "p10-p90 ms", "vs PT", "x floor", "tok/s" if batch > 1 else "% copy", "err")
        for col in cols:
            table.add_column(col, justify="left" if col in ("variant", "err") else "right", no_wrap=True)
        notes = []
        for name, v in rec["variants"].items():
            short = SHORT.get(name, name) + ("*" if name == best else "")
            if v.get("status") != "ok":
                table.add_row(short, *["-"] * (len(cols) - 2), f"[yellow]{v['status']}[/yellow]")
                notes.append(f"  {short}: [yellow]{v['status']}: {v.get('reason', '')}[/yellow]")
                continue
            t, chk = v["timing"], v.get("check", {})
            check = _fmt(chk.get("rel_l2_max", chk.get("rel_l2")), ".1e") + ("" if chk.get("argmax_match")
                                                                              else " argmax")
            last = _fmt(v.get("tokens_per_s"), ".0f") if batch > 1 else f"{v['pct_copy_bw']:.0f}%"
            table.add_row(short, f"{t['median_ms']:.3f}", f"{t['p10_ms']:.3f}-{t['p90_ms']:.3f}",
                          _fmt(v.get("speedup_vs_pytorch_best"), ".2f", "x"), f"{v['x_floor']:.2f}", last,
                          f"[{_colour(chk)}]{check}[/{_colour(chk)}]")
            extra = f"; {v['note']}" if v.get("note") else ""
            if v.get("compile_s") is not None:
                extra += f"; compiled in {v['compile_s']:.0f} s"
            if v.get("schedule_tbps"):
                extra += (f"; the schedule's own bytes (catalogue cost) {rec['schedule_bytes'] / 1e9:.3f} GB at "
                          f"{v['schedule_tbps']:.2f} TB/s")
            if v.get("step_call"):
                extra += f"; Megakernel.step() with its host sync: {v['step_call']['median_ms']:.3f} ms median"
            notes.append(f"  {short}: {v['launch']}{extra}")
        out.append(table)
        out.append("\n".join(notes))
    out.append(LEGEND + (BATCH_LEGEND if batched else ""))
    return out


def batch_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (batch, ctx) of several `synth bench` results: the best PyTorch step and the megakernel (median
    ms and tokens/s), the megakernel's step against its own batch-1 step at that ctx and against the best PyTorch
    step (None where a variant did not run)."""
    rows = []
    one: dict[int, float] = {}  # ctx -> the megakernel's batch-1 step
    for result in results:
        for rec in result["results"]:
            mk = rec["variants"].get("megakernel", {})
            mk_ms = mk["timing"]["median_ms"] if mk.get("status") == "ok" else None
            if rec.get("batch", 1) == 1 and mk_ms is not None:
                one[rec["ctx"]] = mk_ms
            best = rec.get("pytorch_best") or {}
            rows.append({"batch": rec.get("batch", 1), "ctx": rec["ctx"], "pytorch": best.get("variant"),
                         "pytorch_ms": best.get("median_ms"), "megakernel_ms": mk_ms,
                         "pytorch_tokens_per_s": rec.get("batch", 1) / best["median_ms"] * 1e3 if best else None,
                         "megakernel_tokens_per_s": mk.get("tokens_per_s") if mk_ms is not None else None,
                         "vs_pytorch": mk.get("speedup_vs_pytorch_best") if mk_ms is not None else None})
    for row in rows:
        base = one.get(row["ctx"])
        row["vs_batch1"] = row["megakernel_ms"] / base if base and row["megakernel_ms"] is not None else None
    return rows


def batch_table(results: list[dict[str, Any]]) -> Any:
    """Tokens/s by batch (`synth bench --batch 1,2,...`): a rich table of `batch_rows`."""
    from rich import box
    from rich.table import Table

    first = results[0]
    table = Table(title=f"{first['model']}, {first['device']['name']}: tokens/s by batch (the megakernel's step "
                        "against its batch-1 step and the best PyTorch step)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("batch", "ctx", "PyTorch ms", "tok/s", "megakernel ms", "tok/s", "x batch 1", "vs PT"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in batch_rows(results):
        table.add_row(str(r["batch"]), str(r["ctx"]), _fmt(r["pytorch_ms"], ".3f"),
                      _fmt(r["pytorch_tokens_per_s"], ".0f"), _fmt(r["megakernel_ms"], ".3f"),
                      _fmt(r["megakernel_tokens_per_s"], ".0f"), _fmt(r["vs_batch1"], ".2f", "x"),
                      _fmt(r["vs_pytorch"], ".2f", "x"))
    return table
