"""`synth runs …`: browse runs/ — a leaderboard (`list`), one run (`show`), HTML reports (`report`), a server; and
`merge`, one run folder from several machines' folders of one study."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import click

from megasynth.runs.report import Run, fmt_ms, list_runs, load_run, write_index, write_report

_RUNS_DIR = click.option("--runs-dir", type=click.Path(file_okay=False), default="runs", show_default=True,
                         help="The folder that holds one folder per run.")


def _resolve_run(runs_dir: str, name: str) -> Path:
    """A run named by folder name (under runs_dir), by path, or by a unique prefix; a clear error otherwise."""
    p = Path(name)
    if p.is_dir() and any((p / f).exists() for f in ("run.json", "leaderboard.json", "best")):
        return p
    root = Path(runs_dir)
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


@runs.command("list")
@_RUNS_DIR
def list_cmd(runs_dir: str) -> None:
    """The leaderboard: one row per run, newest first."""
    from rich.console import Console
    from rich.table import Table

    found = list_runs(runs_dir)
    if not found:
        click.echo(f"no runs in {runs_dir}/ (run `synth search` first)", err=True)
        return
    table = Table("run", "model", "GPU", "best ms/token", "vs naive", "accepted", "screened", "rejected",
                  "date (UTC)")
    for r in found:
        b, sp = r.best(), r.speedup()
        table.add_row(r.name, r.model, r.gpu, fmt_ms(b.ms, b.estimated) if b else "—",
                      f"{sp:.2f}×" if sp else "—", str(r.accepted), str(r.screened), str(r.rejected), r.date)
    Console(width=200).print(table)


@runs.command("show")
@click.argument("run")
@_RUNS_DIR
def show_cmd(run: str, runs_dir: str) -> None:
    """One run: what ran, the best candidates, what is missing."""
    r = load_run(_resolve_run(runs_dir, run))
    _show(r)


def _show(r: Run) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    b, n, sp = r.best(), r.naive(), r.speedup()
    con.print(f"[bold]{r.name}[/bold]  model {r.model}  GPU {r.gpu}  {r.date} UTC")
    cmd = r.info.get("command")
    if cmd:
        con.print("command: " + (" ".join(map(str, cmd)) if isinstance(cmd, list) else str(cmd)), markup=False)
    con.print(f"best {fmt_ms(b.ms, b.estimated) if b else '—'}   naive {fmt_ms(n.ms, n.estimated) if n else '—'}   "
              f"speed-up {f'{sp:.2f}×' if sp else '—'}   accepted {r.accepted}   screened {r.screened}   "
              f"rejected {r.rejected}")
    if r.entries:
        table = Table("candidate", "proposer", "verdict", "ms/token", "note", title="top candidates")
        order = sorted(r.entries, key=lambda e: (not e.accepted, e.ms if e.ms is not None else float("inf")))
        for e in order[:15]:
            table.add_row(e.candidate, e.proposer, e.verdict, fmt_ms(e.ms, e.estimated), e.note[:60])
        con.print(table)
    trace_file = r.path / "best" / "trace.json"
    if trace_file.is_file():
        from megasynth.runs.report import parse_trace, read_json, summarize
        from megasynth.trace import TraceError, format_summary, read_trace

        try:
            summary = summarize(parse_trace(read_trace(trace_file)), read_json(r.path / "best" / "schedule.json"))
            con.print("best schedule's trace: " + format_summary(summary), markup=False)
        except TraceError as exc:
            con.print(f"note: {exc}", markup=False)
    report = r.path / "report.html"
    con.print(f"report: {report}" if report.exists() else f"report: not written yet (synth runs report {r.name})",
              markup=False)
    for note in r.notes:
        con.print(f"note: {note}", markup=False)


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
        from megasynth.atomic import write_json_atomic
        from megasynth.runs.report import read_json

        notes: list[str] = []
        doc = read_json(Path(bench_file), notes)
        if doc is None:
            click.echo(f"error: {notes[0] if notes else bench_file + ': unreadable'}", err=True)
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
