"""The search loop on the tiny config: runs/ layout, labelled estimates, rejected candidates with their
counterexample, resume after a kill, and two processes sharing one Optuna SQLite storage (more processes, PostgreSQL
and merging: tests/search/test_distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megasynth.lowering.patches import PatchError, apply_patches
from megasynth.lowering.strategy import Strategy
from megasynth.runs.rundir import BASELINE, RunDir
from megasynth.search.config import SearchConfig
from megasynth.search.loop import Search, run_search
from megasynth.search.proposers.auto import ChainProposer, resolve_proposer
from megasynth.search.proposers.base import Proposal, Result, SearchContext
from megasynth.validator.verify import Options, verify


def _cfg(tmp_path: Path, **kw) -> SearchConfig:
    base = dict(model="tiny", workers=8, budget=6, runs_dir=tmp_path, run="r", interleavings=20,
                final_interleavings=50, ctx=64, gpu=False, progress=False, proposer="heuristic", notice=lambda m: None,
                jobs=1)
    base.update(kw)
    return SearchConfig(**base)


def test_search_writes_the_run_layout_and_every_kept_schedule_validates(tmp_path: Path) -> None:
    summary = run_search(_cfg(tmp_path))
    run = tmp_path / "r"
    assert summary.evaluated == 6 and summary.estimated and summary.best_ms is not None
    info = json.loads((run / "run.json").read_text())
    assert info["model"] == "tiny" and info["seed"] == 0 and info["estimated"] is True and "versions" in info
    for name in ("validation.json", "timing.json"):
        assert (run / "best" / name).exists()
    trace = RunDir(run).best_trace()
    assert RunDir(run).has_best_schedule() and trace is not None and trace["metadata"]["estimated"] is True
    timing = json.loads((run / "best" / "timing.json").read_text())
    assert timing["estimated"] is True and "cost model" in timing["source"]
    lb = json.loads((run / "leaderboard.json").read_text())
    assert lb["estimated"] is True and lb["baseline"] == BASELINE
    assert [e["ms"] for e in lb["entries"] if e["accepted"]] == sorted(e["ms"] for e in lb["entries"] if e["accepted"])
    base = json.loads((run / "candidates" / BASELINE / "timing.json").read_text())
    assert base["proposer"] == "naive"
    for cand in (run / "candidates").iterdir():
        sched = RunDir(run).load_candidate(cand.name)
        assert verify(sched, options=Options(interleavings=20)).accepted, cand.name
    keys = [json.loads((c / "timing.json").read_text())["schedule_key"] for c in (run / "candidates").iterdir()]
    assert len(keys) == len(set(keys))  # a proposal that repeats an earlier schedule costs no candidate


def test_rejected_candidates_keep_their_counterexample(tmp_path: Path) -> None:
    search = Search(_cfg(tmp_path))
    search.run.init({"model": "tiny"})
    # Remove the wait of an attention instruction on its QKV producers: a race the validator must find.
    sched = search.evaluator.build(Proposal(Strategy()))
    victim = next(i for i in sched.instructions if i.op == "attn_partial")
    patch = {"op": "remove_wait", "id": victim.id, "counter": victim.waits[0].counter}
    res = search.evaluator.evaluate("c0042", Proposal(Strategy(), [patch], "drop a wait", "test"))
    assert not res.accepted and res.counterexample
    rec = json.loads((tmp_path / "r" / "rejected" / "c0042.json").read_text())
    assert rec["reason"] == "rejected" and rec["patches"] == [patch]
    assert any(f["category"] == "race" for f in rec["findings"])
    # A malformed patch is rejected with its index and field, not a traceback.
    res = search.evaluator.evaluate("c0043", Proposal(Strategy(), [{"op": "move", "id": 10**6, "worker": 0}]))
    assert not res.accepted and "$.patches[0].id" in (res.error or "")


def test_resume_keeps_accepted_results_and_continues(tmp_path: Path) -> None:
    first = run_search(_cfg(tmp_path, budget=4))
    before = set(RunDir(first.run_dir).accepted())
    # A killed process leaves files and trials; resuming continues the study up to the new budget.
    second = run_search(_cfg(tmp_path, budget=7, resume=True, proposer="evolve"))
    after = RunDir(second.run_dir).accepted()
    assert before <= set(after)
    assert second.evaluated == 3
    assert len(RunDir(second.run_dir).accepted()) + len(RunDir(second.run_dir).rejected()) == 7


def test_auto_without_llm_is_seeds_then_descent_then_evolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    notes: list[str] = []
    p = resolve_proposer("auto", "tiny", 8, notice=notes.append, ctx=64)
    assert isinstance(p, ChainProposer) and len(notes) == 1 and "seeds" in notes[0] and "descent" in notes[0]
    with pytest.raises(ValueError, match="OPENAI"):
        resolve_proposer("llm", "tiny", 8)
    ctx = SearchContext("tiny", 8, "cpu", None, [], None, True)
    props = p.propose(ctx, 5)  # a call ends with the stage that filled it: the seeds go out before the descent runs
    assert [x.proposer for x in props] == ["seeds"] * 3
    props = p.propose(ctx, 5)
    assert len(props) == 5 and all(isinstance(x.strategy, Strategy) for x in props)
    assert [x.proposer for x in props] == ["descent"] * 5


def test_evolve_uses_accepted_parents() -> None:
    from megasynth.lowering.models import get_model
    from megasynth.lowering.strategy import SearchSpace
    from megasynth.search.proposers.evolve import EvolveProposer

    ev = EvolveProposer(SearchSpace(get_model("tiny"), 8), seed=1)
    parents = [Result(f"c000{k}", Proposal(Strategy(attn_splits=k + 1)), True, 1.0 + k, True,
                      profile={"critical_path": [3, 4, 5]}) for k in range(3)]
    ctx = SearchContext("tiny", 8, "cpu", parents[0], parents, 1.0, True)
    props = ev.propose(ctx, 6)
    assert len(props) == 6 and all(p.parent in {"c0000", "c0001", "c0002"} for p in props)


def test_patches_errors_name_index_and_field(tmp_path: Path) -> None:
    from megasynth.lowering.lower import lower
    from megasynth.lowering.models import get_model

    sched = lower(get_model("tiny"), 4)
    moved = apply_patches(sched, [{"op": "move", "id": 5, "worker": 3}])
    assert 5 in moved.queues[3] and moved.queues[3] == sorted(moved.queues[3])
    for bad, where in [([{"op": "move", "id": 5, "worker": 9}], "$.patches[0].worker"),
                       ([{"op": "fly", "id": 5}], "$.patches[0].op"),
                       ([{"op": "move", "id": 5, "worker": 1}, {"op": "set_wait", "id": 0, "counter": 0,
                                                               "value": 1}], "$.patches[1].counter"),
                       ([{"op": "add_wait", "id": 5, "counter": 1, "value": -1}], "$.patches[0].value"),
                       ([{"op": "add_signal", "id": 5, "counter": 1, "add": 1, "x": 1}], "$.patches[0].x")]:
        with pytest.raises(PatchError) as exc:
            apply_patches(sched, bad)
        assert exc.value.path == where, (bad, str(exc.value))
    grown = apply_patches(sched, [{"op": "add_signal", "id": 5, "counter": sched.counters + 3}])
    assert grown.counters == sched.counters + 4


_WORKER = """
import sys
from pathlib import Path
from megasynth.search.config import SearchConfig
from megasynth.search.loop import run_search
run_search(SearchConfig(model="tiny", workers=8, budget=int(sys.argv[3]), runs_dir=Path(sys.argv[1]), run="shared",
                        resume=sys.argv[2] == "resume", storage=None, interleavings=10, final_interleavings=20,
                        ctx=64, gpu=False, progress=False, proposer="evolve", seed=int(sys.argv[4]),
                        notice=lambda m: None))
"""


def test_two_processes_share_one_sqlite_study(tmp_path: Path) -> None:
    import optuna

    run_search(_cfg(tmp_path, run="shared", budget=2))  # creates the run, the study and the baseline
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path), "resume", "10", str(seed)], env=env,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    storage = f"sqlite:///{tmp_path / 'shared' / 'study.db'}"
    study = optuna.load_study(study_name="megasynth-shared", storage=storage)
    cands = [t.user_attrs["candidate"] for t in study.trials]
    assert sorted(cands) == [f"c{n:04d}" for n in range(10)]  # the budget is exact: one trial per candidate
    run = RunDir(tmp_path / "shared")
    assert set(run.accepted()) | set(run.rejected()) == set(cands)
    keys = [t.user_attrs["schedule_key"] for t in study.trials]
    assert len(set(keys)) == len(keys)  # no schedule evaluated twice
    pids = {t.user_attrs.get("pid") for t in study.trials if t.user_attrs["candidate"] >= "c0002"}
    assert len(pids) == 2  # both processes contributed candidates


def test_search_cli_on_tiny(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from megasynth.cli import main

    res = CliRunner().invoke(main, ["search", "--model", "tiny", "--workers", "6", "--budget", "3", "--runs-dir",
                                    str(tmp_path), "--run", "cli", "--interleavings", "10", "--final-interleavings",
                                    "20", "--ctx", "32", "--cpu", "--proposer", "heuristic", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "estimated by the cost model" in res.output and RunDir(tmp_path / "cli").has_best_schedule()
    assert not [ln for ln in res.stderr.splitlines() if ln.startswith("search ")]  # --no-progress: no lines either
    res = CliRunner().invoke(main, ["search", "--model", "tiny", "--resume", "nope", "--runs-dir", str(tmp_path),
                                    "--cpu", "--no-progress"])
    assert res.exit_code == 2 and "cannot resume" in res.output


def test_search_cli_prints_a_progress_line_per_candidate_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """Under CliRunner stderr is not a terminal (as in CI or `| tee log`): instead of a progress bar, one plain line
    per finished candidate, with its outcome and the best so far."""
    from click.testing import CliRunner

    from megasynth.cli import main

    res = CliRunner().invoke(main, ["search", "--model", "tiny", "--workers", "6", "--budget", "3", "--runs-dir",
                                    str(tmp_path), "--run", "log", "--interleavings", "10", "--final-interleavings",
                                    "20", "--ctx", "32", "--cpu", "--proposer", "heuristic", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("search ")]
    counts = [ln.split()[1] for ln in lines]
    assert counts == ["0/3", "1/3", "2/3", "3/3"], res.stderr
    for cid, line in zip(("c0000", "c0001", "c0002"), lines[1:], strict=True):
        assert f"{cid} accepted" in line or f"{cid} rejected" in line, line
    assert "c0000 accepted" in lines[1] and "best c0000" in lines[1] and "(estimated)" in lines[1]
    assert "\x1b[" not in res.stderr  # plain text: no bar, no terminal codes


def test_progress_lines_say_the_search_is_waiting_when_nothing_finishes(capsys: pytest.CaptureFixture[str]) -> None:
    from megasynth.search.evaluate import Standing
    from megasynth.search.loop import _Progress

    progress = _Progress(5, enabled=True, terminal=False)
    standing = Standing()
    progress.update(0, standing, True)
    progress.update(0, standing, True)  # nothing new within LINE_EVERY_S: no line
    progress.LINE_EVERY_S = 0.0
    progress.update(0, standing, True)
    standing.remember(Result("c0000", Proposal(Strategy()), True, 0.25, True), None)
    progress.update(1, standing, True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[0].startswith("search 0/5") and "waiting" in lines[1], lines
    assert lines[2].startswith("search 1/5") and "c0000 accepted 0.2500 ms" in lines[2] and "best c0000" in lines[2]
    silent = _Progress(5, enabled=False, terminal=False)
    silent.update(1, standing, True)
    assert capsys.readouterr().err == ""


def test_jobs_default_to_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from megasynth.search import config

    assert [config.default_jobs(False, n) for n in (1, 2, 3, 64)] == [1, 2, 3, config.MAX_DEFAULT_JOBS]
    assert [config.default_jobs(True, n) for n in (1, 2, 3, 64)] == [1, 1, 2, config.MAX_DEFAULT_JOBS]
    monkeypatch.delattr(config.os, "process_cpu_count", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert config.available_cores() == 3 and config.default_jobs(False) == 3 and config.default_jobs(True) == 2
    monkeypatch.setattr(config.os, "process_cpu_count", lambda: 5, raising=False)
    assert config.available_cores() == 5


def test_the_search_resolves_jobs_for_its_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --jobs left out the loop asks `default_jobs` for its device (and runs in-process when it says 1)."""
    import megasynth.search.loop as loop

    asked: list[bool] = []
    monkeypatch.setattr(loop, "default_jobs", lambda gpu: asked.append(gpu) or 1)
    monkeypatch.setattr(loop, "Pool", None)  # a pool would fail: jobs=1 runs in this process
    summary = run_search(_cfg(tmp_path, jobs=None, budget=2))
    assert asked == [False] and summary.evaluated == 2


@pytest.mark.gpu
def test_search_times_on_the_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    summary = run_search(_cfg(tmp_path, gpu=True, budget=3, workers=None))
    assert not summary.estimated and summary.best_ms is not None
    timing = json.loads((summary.run_dir / "best" / "timing.json").read_text())
    from megasynth.search.evaluate import SCHEDULE_TOL

    assert timing["estimated"] is False and timing["check_rel_l2"] <= SCHEDULE_TOL  # fp32: ~1e-6 from the naive one
    trace = RunDir(summary.run_dir).best_trace()
    assert trace is not None and trace["metadata"]["estimated"] is False


def test_a_killed_search_resumes_without_losing_accepted_results(tmp_path: Path) -> None:
    import signal
    import time

    import optuna

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    code = _WORKER.replace('run="shared"', 'run="killed"')
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "new", "1000", "3"], env=env,
                            stderr=subprocess.DEVNULL)
    run = RunDir(tmp_path / "killed")
    deadline = time.monotonic() + 90
    while len(run.accepted()) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = run.accepted()
    assert len(before) >= 4, "the search did not get going"
    storage = f"sqlite:///{tmp_path / 'killed' / 'study.db'}"
    n_before = len(optuna.load_study(study_name="megasynth-killed", storage=storage).trials)
    summary = run_search(_cfg(tmp_path, run="killed", resume=True, budget=n_before + 3, proposer="evolve"))
    after = RunDir(summary.run_dir).accepted()
    assert set(before) <= set(after) and all(after[c]["ms"] == before[c]["ms"] for c in before)
    study = optuna.load_study(study_name="megasynth-killed", storage=storage)
    # The dead process's claim (the candidate it was evaluating) was freed and its slot used again: every claim is
    # done and recorded by exactly one trial.
    from megasynth.runs.study import Claims, make_engine

    rows = Claims(make_engine(storage), "megasynth-killed", owner="test").rows()
    assert all(r["state"] == "done" for r in rows) and len(rows) == n_before + 3 == len(study.trials)
    assert (summary.run_dir / "best" / "timing.json").exists()
    lb = json.loads((summary.run_dir / "leaderboard.json").read_text())
    assert {e["candidate"] for e in lb["entries"] if e["accepted"]} == set(after)


class _FakeTimer:
    """Stands in for GpuTimer (no CUDA here): a fixed logits error, a fixed time, or a failure."""

    device = "fake GPU"

    def __init__(self, err: float = 0.0, fail: bool = False, tolerance: float = 2e-2) -> None:
        self.err, self.fail, self.tolerance = err, fail, tolerance

    def check(self, schedule) -> float:
        if self.fail:
            raise RuntimeError("watchdog: worker 3 stuck")
        return self.err

    def time(self, schedule) -> dict:
        return {"ms": 0.5, "median_ms": 0.5, "estimated": False, "source": "GPU (fake GPU)"}

    def trace(self, schedule) -> None:
        return None


def test_gpu_path_checks_logits_and_keeps_failures(tmp_path: Path) -> None:
    search = Search(_cfg(tmp_path, gpu=True))
    search.run.init({"model": "tiny"})
    search.evaluator.timer = _FakeTimer()
    res = search.evaluator.evaluate("c0001", Proposal(Strategy(attn_splits=2), proposer="test"))
    assert res.accepted and res.ms == 0.5 and res.estimated is False
    timing = json.loads((tmp_path / "r" / "candidates" / "c0001" / "timing.json").read_text())
    assert timing["estimated"] is False and timing["check_rel_l2"] == 0.0 and "estimate_ms" in timing
    search.evaluator.timer = _FakeTimer(err=0.5)
    res = search.evaluator.evaluate("c0002", Proposal(Strategy(attn_splits=3), proposer="test"))
    rec = json.loads((tmp_path / "r" / "rejected" / "c0002.json").read_text())
    assert not res.accepted and rec["reason"] == "gpu_mismatch"
    search.evaluator.timer = _FakeTimer(fail=True)
    res = search.evaluator.evaluate("c0003", Proposal(Strategy(attn_splits=4), proposer="test"))
    rec = json.loads((tmp_path / "r" / "rejected" / "c0003.json").read_text())
    assert not res.accepted and rec["reason"] == "gpu_error" and "watchdog" in rec["error"]


def test_the_evaluator_rejects_by_the_timers_tolerance(tmp_path: Path) -> None:
    search = Search(_cfg(tmp_path, gpu=True))
    search.run.init({"model": "tiny"})
    search.evaluator.timer = _FakeTimer(err=0.03, tolerance=5e-2)  # a batch's bound: bf16 rounding passes
    assert search.evaluator.evaluate("c0001", Proposal(Strategy(attn_splits=2), proposer="test")).accepted
    search.evaluator.timer = _FakeTimer(err=0.03, tolerance=2e-2)
    res = search.evaluator.evaluate("c0002", Proposal(Strategy(attn_splits=3), proposer="test"))
    rec = json.loads((tmp_path / "r" / "rejected" / "c0002.json").read_text())
    assert not res.accepted and rec["reason"] == "gpu_mismatch" and "> 0.02)" in rec["error"]


def test_the_gpu_check_holds_a_batch_to_bf16_rounding_on_every_sequence() -> None:
    torch = pytest.importorskip("torch")
    from megasynth.measure.torch_step import CHECK_TOL, PYTORCH_TOL
    from megasynth.search.evaluate import check_tolerance, worst_rel_l2

    assert check_tolerance(8) == PYTORCH_TOL
    # batch 1: two fp32 schedules (measured <= 3e-6 apart) pass; a step 1e-3 off, which the bench's bound against the
    # reference would let through, is a mismatch
    assert 3e-6 < check_tolerance(1) < 1e-3 < CHECK_TOL
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 1000, generator=gen)
    noise = torch.randn(8, 1000, generator=gen)
    unit = noise / noise.norm(dim=1, keepdim=True) * ref.norm(dim=1, keepdim=True)
    # two correct batch-8 steps, every sequence 2.3e-2 apart by rounding (llama-1b's measured 1.6-2.4e-2): accepted
    assert 0.02 < worst_rel_l2(ref + 0.023 * unit, ref) <= check_tolerance(8)
    # one sequence 0.1 off (say, its attention raced): 0.035 over the whole batch, inside the bound; caught per sequence
    wrong = ref.clone()
    wrong[3] += 0.1 * unit[3]
    assert float((wrong - ref).norm() / ref.norm()) < check_tolerance(8) < worst_rel_l2(wrong, ref)
    assert worst_rel_l2(ref[0] * 1.01, ref[0]) == pytest.approx(0.01, rel=1e-4)  # batch 1: one vector


def test_a_best_that_fails_the_full_replay_is_demoted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import megasynth.search.evaluate as search_mod
    from megasynth.ir.program import Finding

    real = search_mod.verify

    def picky(schedule, file=None, options=None):
        report = real(schedule, file, options)
        if options is not None and options.interleavings == 50 and file == "c0001":
            report.findings.append(Finding("race", "replay witness: stale read (planted by the test)", [0]))
        return report

    monkeypatch.setattr(search_mod, "verify", picky)
    search = Search(_cfg(tmp_path, final_interleavings=50))
    search.run.init({"model": "tiny"})
    res = search.evaluator.evaluate("c0001", Proposal(Strategy(attn_splits=2), proposer="test"))
    assert not res.accepted
    assert not (tmp_path / "r" / "candidates" / "c0001").exists()
    rec = json.loads((tmp_path / "r" / "rejected" / "c0001.json").read_text())
    assert rec["reason"] == "rejected" and "planted" in rec["findings"][0]["message"]


def test_tpe_proposer_runs_a_search(tmp_path: Path) -> None:
    summary = run_search(_cfg(tmp_path, proposer="tpe", budget=5))
    assert summary.evaluated == 5
    props = {json.loads((c / "timing.json").read_text())["proposer"]
             for c in (summary.run_dir / "candidates").iterdir()}
    assert "tpe" in props


def test_parallel_validation_workers(tmp_path: Path) -> None:
    summary = run_search(_cfg(tmp_path, jobs=2, budget=7, proposer="auto"))
    run = RunDir(summary.run_dir)
    assert summary.evaluated == 7 and len(run.accepted()) + len(run.rejected()) == 7
    keys = [t["schedule_key"] for t in run.accepted().values()]
    assert len(keys) == len(set(keys))
    for cid in run.accepted():
        v = json.loads((summary.run_dir / "candidates" / cid / "validation.json").read_text())
        assert v["verdict"] == "accepted" and v["interleavings"] == 20
    assert RunDir(summary.run_dir).best_trace() is not None


class _FakeAgent:
    """An agent that proposes `left` times, then reports itself exhausted."""

    name = "llm"

    def __init__(self, left: int) -> None:
        self.left, self.seen = left, []

    @property
    def exhausted(self) -> bool:
        return self.left <= 0

    def propose(self, ctx, n):
        if self.left <= 0:
            return []
        self.left -= 1
        return [Proposal(Strategy(attn_splits=2), rationale="agent", proposer="llm")]

    def observe(self, result) -> None:
        self.seen.append(result)


def test_auto_falls_back_to_builtin_when_the_agent_is_exhausted() -> None:
    from megasynth.lowering.models import get_model
    from megasynth.lowering.strategy import SearchSpace
    from megasynth.search.proposers.auto import FallbackProposer
    from megasynth.search.proposers.heuristic import HeuristicProposer

    notices: list[str] = []
    agent = _FakeAgent(left=2)
    auto = FallbackProposer(agent, HeuristicProposer(SearchSpace(get_model("tiny"), 4), 0), notices.append)
    ctx = SearchContext("tiny", 4, "cost model (CPU)", None, [], None, True)
    assert [p.proposer for p in auto.propose(ctx, 4)] == ["llm"]
    assert [p.proposer for p in auto.propose(ctx, 4)] == ["llm"]
    assert not notices
    builtin = auto.propose(ctx, 3)
    assert builtin and all(p.proposer != "llm" for p in builtin)
    assert len(notices) == 1 and "built-in search" in notices[0]
    auto.propose(ctx, 1)
    assert len(notices) == 1  # said once


def test_resume_keeps_the_runs_batch_and_context_length(tmp_path: Path) -> None:
    """A batch run searched at a context length of its own resumes with both, without --max-seq-len again."""
    run_search(_cfg(tmp_path, budget=2, sequences=2, max_seq_len=128))
    search = Search(_cfg(tmp_path, budget=3, resume=True, sequences=2))
    assert (search.spec.batch, search.spec.max_seq_len) == (2, 128)
