"""`synth runs …`: browse runs/ — a leaderboard (`list`), one run (`show`), HTML reports (`report`), a server; and
`merge`, one run folder from several machines' folders of one study; `pack`, a run's candidate folders as one file."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from megasynth.runs.reader import Run, bench_problem, list_runs, load_run, parse_trace, read_json, summarize
from megasynth.runs.report import fmt_ms, ranking_decimals, write_index, write_report
from megasynth.runs.rundir import run_name_problem
from megasynth.trace import format_layer_chain

_RUNS_DIR = click.option("--runs-dir", type=click.Path(file_okay=False), default="runs", show_default=True,
                         help="The folder that holds one folder per run.")


def _resolve_run(runs_dir: str, name: str) -> Path:
    """A run named by folder name (under runs_dir), by path, or by a unique prefix; a clear error otherwise. Only a
    plain run name is looked up under runs_dir (`..` or `a/b` there would reach folders that are no runs of it, and a
    report would be written there); a path must lead to a run folder itself."""
    p = Path(name)
    if p.is_dir() and any((p / f).exists() for f in ("run.json", "leaderboard.json", "best")):
        return p
    root = Path(runs_dir)
    problem = run_name_problem(name)
    if problem is not None:
        raise click.BadParameter(f"{name!r} is no run folder, and {problem}", param_hint="RUN")
    if (root / name).is_dir():
        return root / name
    matches = [r.path for r in list_runs(root) if r.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(r.name for r in list_runs(root)[:10]) or "none"
    what = "is ambiguous" if matches else "not found"
    raise click.BadParameter(f"run {name!r} {what} in {root}/ (runs: {known})", param_hint="RUN")


@click.group("runs", context_settings={"help_option_names": ["-h", "--help"]})
def runs() -> None:
    """Browse runs/: a leaderboard, one run's summary, HTML reports with the SM timeline, a local server."""


def _console() -> Any:
    """A console as wide as the terminal (COLUMNS, else 80 when not a terminal): every table fits it, wrapping its
    text columns rather than running past the edge."""
    from rich.console import Console

    return Console(highlight=False)


def _table(*columns: tuple[str, dict[str, Any]], **options: Any) -> Any:
    """A table with light rules and one space between columns (narrow enough for 80 columns): `columns` are
    (header, `rich.table.Column` options); numbers do not wrap, text columns share what is left."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False, **options)
    for header, opts in columns:
        table.add_column(header, **opts)
    return table


@runs.command("list")
@_RUNS_DIR
def list_cmd(runs_dir: str) -> None:
    """The leaderboard: one row per run, newest first."""
    found = list_runs(runs_dir)
    if not found:
        click.echo(f"no runs in {runs_dir}/ (run `synth search` first)", err=True)
        return
    bests = [r.best() for r in found]
    dec = ranking_decimals([b.ms for b in bests if b is not None])
    counts = [f"{r.accepted}/{r.screened}/{r.rejected}" for r in found]
    con = _console()
    # Fixed widths (rich would rather crop a table than wrap it enough): every column but the run's name takes
    # what its values need, wrapping at spaces (a date over two lines); the name has the rest and folds beyond it.
    widths = {"model": max(5, *(len(r.model) for r in found)), "best ms/token": 11, "vs naive": 8,
              "a/s/r": max(5, *map(len, counts)), "GPU": 11, "date (UTC)": 10}
    name_w = max(12, min(max(len(r.name) for r in found), con.width - sum(widths.values()) - len(widths)))
    table = _table(("run", {"overflow": "fold", "width": name_w}),
                   *((h, {"width": w, "justify": "right" if h in ("vs naive", "a/s/r") else "left"})
                     for h, w in widths.items()),
                   caption="a/s/r: candidates accepted / screened by the cost model / rejected")
    for r, b, n in zip(found, bests, counts, strict=True):
        sp = r.speedup()
        table.add_row(r.name, r.model, fmt_ms(b.ms, b.estimated, dec) if b else "—", f"{sp:.2f}×" if sp else "—",
                      n, r.gpu, r.date)
    con.print(table)


@runs.command("show")
@click.argument("run")
@_RUNS_DIR
def show_cmd(run: str, runs_dir: str) -> None:
    """One run: what ran, the best candidates, what is missing."""
    r = load_run(_resolve_run(runs_dir, run))
    _show(r)


def _show(r: Run) -> None:
    con = _console()
    b, n, sp = r.best(), r.naive(), r.speedup()
    con.print(f"[bold]{r.name}[/bold]  model {r.model}  GPU {r.gpu}  {r.date} UTC")
    cmd = r.info.get("command")
    if cmd:  # one line however wide: it is copied and run again
        con.print("command: " + (" ".join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)), markup=False,
                  soft_wrap=True)
    order = sorted(r.entries, key=lambda e: (not e.accepted, e.ms if e.ms is not None else float("inf")))[:15]
    dec = ranking_decimals([e.ms for e in order] + [x.ms for x in (b, n) if x is not None])
    best_txt, naive_txt = (fmt_ms(x.ms, x.estimated, dec) if x else "—" for x in (b, n))
    con.print(f"best {best_txt}   naive {naive_txt}   speed-up {f'{sp:.2f}×' if sp else '—'}   accepted {r.accepted}   "
              f"screened {r.screened}   rejected {r.rejected}")
    if order:
        # one label in the header when every time is the cost model's, not one per row
        all_est = all(e.estimated for e in order if e.ms is not None)
        table = _table(("candidate", {"no_wrap": True}), ("proposer", {"no_wrap": True}), ("verdict", {}),
                       ("ms/token (estimated)" if all_est else "ms/token", {"justify": "right"}), ("note", {}),
                       title="top candidates")
        for e in order:
            note = e.note if len(e.note) <= 60 else e.note[:59] + "…"
            table.add_row(e.candidate, e.proposer, e.verdict, fmt_ms(e.ms, e.estimated and not all_est, dec), note)
        con.print(table)
    notes: list[str] = []
    trace_doc = read_json(r.path / "best" / "trace.json", notes)
    if trace_doc is not None:
        try:
            summary = summarize(parse_trace(trace_doc), read_json(r.path / "best" / "schedule.json"))
        except ValueError as exc:  # a TraceError names the bad event
            con.print(f"note: {exc}", markup=False)
        else:
            _print_trace_summary(con, summary)
    for note in notes:
        con.print(f"note: {note}", markup=False)
    report = r.path / "report.html"
    con.print(f"report: {report}" if report.exists() else f"report: not written yet (synth runs report {r.name})",
              markup=False)
    for note in r.notes:
        con.print(f"note: {note}", markup=False)


def _print_trace_summary(con: Any, summary: dict[str, Any], top: int = 8) -> None:
    """`megasynth.trace.summarize`'s result: the makespan and load, time per op (a table) and the critical path."""
    tag = " (estimated)" if summary.get("estimated") else ""
    con.print(f"best schedule's trace: makespan {summary['makespan_us']:.1f} µs{tag}, {summary['instructions']} "
              f"instructions on {summary.get('workers', 0)} SMs, busy {100 * summary.get('busy_fraction', 0):.0f}%, "
              f"waiting {100 * summary.get('wait_fraction', 0):.0f}%", markup=False)
    right = {"justify": "right", "no_wrap": True}
    table = _table(("op", {"no_wrap": True}), ("n", right), ("total µs", right), ("mean µs", right),
                   ("waited µs", right))
    for op, d in list(summary["per_op"].items())[:top]:
        table.add_row(op, str(d["count"]), f"{d['total_us']:.1f}", f"{d['mean_us']:.2f}", f"{d['wait_us']:.1f}")
    con.print(table)
    cp = summary.get("critical_path_by_op_us", {})
    if cp:
        con.print("critical path: " + ", ".join(f"{op} {us:.1f} µs" for op, us in cp.items()), markup=False)
    if summary.get("layer_chain"):
        con.print(format_layer_chain(summary["layer_chain"]).replace(" us", " µs"), markup=False)


@runs.command("report")
@click.argument("run", required=False)
@click.option("--bench", "bench_file", type=click.Path(exists=True, dir_okay=False),
              help="A `synth bench --json` file to keep in the run (as bench.json) and chart: baselines and floor.")
@_RUNS_DIR
def report_cmd(run: str | None, bench_file: str | None, runs_dir: str) -> None:
    """Write runs/<run>/report.html (every run when RUN is left out) and runs/index.html."""
    paths = [_resolve_run(runs_dir, run)] if run else [r.path for r in list_runs(runs_dir)]
    if bench_file:
        if not run:
            raise click.BadParameter("--bench needs a RUN (the bench belongs to one run)", param_hint="--bench")
        import json

        from megasynth.atomic import write_json_atomic

        try:
            doc = json.loads(Path(bench_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            click.echo(f"error: {bench_file}: cannot read ({getattr(exc, 'strerror', None) or exc})", err=True)
            sys.exit(2)
        except json.JSONDecodeError as exc:
            click.echo(f"error: {bench_file}: invalid JSON ({exc.msg} at line {exc.lineno})", err=True)
            sys.exit(2)
        info = load_run(paths[0]).info
        model = info.get("model") if isinstance(info.get("model"), str) else None
        batch = info.get("batch") if isinstance(info.get("batch"), int) else None
        problem = bench_problem(doc, model, batch)
        if problem is not None:  # nothing is stored: the run keeps the bench it had
            click.echo(f"error: {bench_file}: {problem}; not kept in {paths[0]}", err=True)
            sys.exit(2)
        write_json_atomic(paths[0] / "bench.json", doc)
    for p in paths:
        click.echo(str(write_report(p)))
    if Path(runs_dir).is_dir():
        click.echo(str(write_index(runs_dir)))
    elif not paths:
        click.echo(f"error: {runs_dir}/ does not exist", err=True)
        sys.exit(2)


@runs.command("merge")
@click.argument("folders", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="The merged run folder (new, or empty).")
@click.option("--storage", default=None, metavar="URL",
              help="The study's database [default: the storage URL the folders' run.json names].")
def merge_cmd(folders: tuple[str, ...], output: str, storage: str | None) -> None:
    """One run folder and one leaderboard from the folders of machines that worked one study (same --run name and
    --storage) without sharing runs/: the study says which candidates exist, the folders hold their files."""
    from megasynth.runs.merge import merge_runs

    try:
        m = merge_runs([Path(f) for f in folders], Path(output), storage)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    parts = [f"{n} from {src}" for src, n in m.copied.items()]
    if m.from_study:
        parts.append(f"{len(m.from_study)} from the study alone ({', '.join(m.from_study[:8])}"
                     f"{', ...' if len(m.from_study) > 8 else ''}: timing and validation, no schedule.json)")
    click.echo(f"{m.path}: {m.candidates} candidates ({'; '.join(parts)}); best {m.best or '—'}")
    if m.running:
        click.echo(f"note: still being evaluated, not merged: {', '.join(m.running)}", err=True)
    if m.left_out:
        click.echo(f"note: files the study does not have, left out: {', '.join(m.left_out)}", err=True)
    for note in m.notes:
        click.echo(f"note: {note}", err=True)


@runs.command("pack")
@click.argument("run")
@_RUNS_DIR
def pack_cmd(run: str, runs_dir: str) -> None:
    """Pack a run's accepted candidates into one file, candidates.json.gz (three or four files per candidate become
    one; every reader reads the run as before). The pack is written first, then the folders it holds are removed;
    packing again merges candidates added since (a resumed search). For a run no search is writing to."""
    from megasynth.runs.rundir import PackError, RunDir

    try:
        path = _resolve_run(runs_dir, run)
    except click.BadParameter as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(2)
    try:
        done = RunDir(path).pack()
    except PackError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        click.echo(f"error: {getattr(exc, 'filename', None) or path}: {exc.strerror or exc}", err=True)
        sys.exit(2)
    if done.packed:
        click.echo(f"{done.pack}: {len(done.packed)} candidates packed ({done.total} in the pack), "
                   f"{done.bytes_before:,} bytes before, {done.bytes_after:,} after")
    else:
        click.echo(f"{done.pack}: nothing to pack ({done.total} candidates in the pack already)")
    if done.left:
        click.echo(f"note: left as they are (no timing.json yet): {', '.join(done.left)}", err=True)


def make_server(runs_dir: str | Path, port: int = 0) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 serving runs_dir (reports written first). Port 0 picks a free port."""
    root = Path(runs_dir)
    if not root.is_dir():
        raise click.BadParameter(f"{root}/ does not exist", param_hint="--runs-dir")
    for r in list_runs(root):
        write_report(r.path)
    write_index(root)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class names it so
            pass

        def send_head(self) -> Any:
            """X.json that a run keeps as X.json.gz is served decompressed (a trace for a viewer without gzip)."""
            path = Path(self.translate_path(self.path))
            gz = path.with_name(path.name + ".gz")
            if path.suffix != ".json" or path.exists() or not gz.is_file():
                return super().send_head()
            import io

            from megasynth.atomic import read_text

            try:
                data = read_text(gz).encode("utf-8")
            except (OSError, UnicodeDecodeError):
                self.send_error(500, f"{gz.name} is not a readable gzip file")
                return None
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return io.BytesIO(data)

    handler: Callable[..., Handler] = functools.partial(Handler, directory=str(root))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


@runs.command("serve")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@_RUNS_DIR
def serve_cmd(port: int, runs_dir: str) -> None:
    """Serve runs/ on http://127.0.0.1:PORT/ (reports regenerated at start); Ctrl-C stops it."""
    try:
        server = make_server(runs_dir, port)
    except OSError as exc:
        click.echo(f"error: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}", err=True)
        sys.exit(2)
    host, real_port = server.server_address[:2]
    click.echo(f"serving {runs_dir}/ at http://{host}:{real_port}/index.html (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def serve_in_thread(runs_dir: str | Path, port: int = 0) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    """Start the server in a daemon thread (tests, screenshots); stop with `server.shutdown()`."""
    server = make_server(runs_dir, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
