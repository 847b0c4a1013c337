"""The evaluator: one proposal -> lowered and patched schedule -> validated -> timed on the GPU or estimated by the cost
model -> written to runs/<run>/ as an accepted or rejected candidate (and to best/ when it is the fastest so far).

The loop (`search.loop`) decides what to evaluate and keeps the study; the pool (`search.pool`) may do
the lowering and validation ahead in worker processes and hand the evaluator their results.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import Schedule
from megasynth.kernels.gpu.pack import (
    check_runs_batched_on_v10,
    check_runs_on_v9,
    default_batch_interpreter,
    pack,
    v10_tile_slots,
)
from megasynth.kernels.gpu.timing import GpuHangError
from megasynth.lowering.costmodel import CostParams, Estimate, estimate
from megasynth.lowering.lower import lower
from megasynth.lowering.models import ModelSpec
from megasynth.lowering.patches import apply_patches
from megasynth.lowering.strategy import Strategy
from megasynth.measure.torch_step import PYTORCH_TOL, compare
from megasynth.runs.rundir import BASELINE, RunDir, schedule_key
from megasynth.search.config import SearchConfig
from megasynth.search.proposers.base import Proposal, Result
from megasynth.validator.verify import Options, Report, verify

# --------------------------------------------------------------------------------------------------------------
# Timing


def cuda_available() -> bool:
    """True when torch sees a CUDA device (torch is imported only to ask; triton never is on a CPU)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def default_workers() -> int:
    """The GPU's SM count when CUDA is present, else 132 (an H100/H200)."""
    if cuda_available():
        import torch

        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return 132


def gpu_name() -> str:
    """The CUDA device's name, for run.json."""
    import torch

    return str(torch.cuda.get_device_name(0))


#: How far a correct schedule's batch-1 step may be from the naive schedule's on the same build: both compute in
#: fp32 and differ only in the order of their additions (K splits' atomic adds, attention's split merge). Searches of
#: llama-1b and qwen3-0.6b on the H200 measured at most 2.0e-6 and 3.0e-6 over 12 candidates each (docs/perf-notes.md),
#: so this leaves ~30x; a schedule whose race corrupts one partial sum is off by far more.
SCHEDULE_TOL = 1e-4


def check_tolerance(batch: int) -> float:
    """How far (relative L2 of the worst sequence's logits) a correct schedule's step may be from the naive
    schedule's on the same build. At batch 1 the interpreter computes in fp32 and schedules agree to ~1e-6
    (`SCHEDULE_TOL`), far inside the bench's CHECK_TOL against the reference. A batch stages x and its activations in
    16 bits: each schedule's logits are ~2e-2 from the fp32 reference with rounding of its own (the order of its K
    splits' atomic adds), and correct schedules measured 1.6-2.4e-2 from the naive one on llama-1b at batch 8
    (docs/perf-notes.md). So a batch is held to PyTorch's bf16 bound, as `synth bench` holds a bf16 step. A wrong
    step is off by ~1."""
    return SCHEDULE_TOL if batch == 1 else PYTORCH_TOL


def worst_rel_l2(got: Any, ref: Any) -> float:
    """Relative L2 distance of logits `got` from `ref` (`torch_step.compare`): of the worst sequence where they are
    [batch, vocab], so that one sequence's error is not diluted by the others'."""
    c = compare(got, ref)
    return float(c.get("rel_l2_max", c["rel_l2"]))


class GpuTimer:
    """Times schedules on the persistent interpreter (one compiled kernel; each schedule is new tables). Every timed
    schedule's logits are first compared with the naive schedule's at the same position (a kernel bug in a new
    tiling shows up here, not in the leaderboard), within `tolerance` (`check_tolerance` of the build's batch)."""

    def __init__(self, schedule: Schedule, ctx: int, reps: int = 50, seed: int = 0) -> None:
        import torch

        from megasynth.ir.model import ModelConfig
        from megasynth.kernels.gpu import Megakernel
        from megasynth.kernels.weights import random_tensor, weight_shapes

        assert schedule.model is not None
        cfg = ModelConfig.from_hf(schedule.model.config)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        weights: dict[str, Any] = {}
        for name, shape in weight_shapes(cfg).items():  # random_weights' rule, drawn on the GPU (fast)
            weights[name] = random_tensor(cfg, name, shape, gen, "cuda").to(torch.bfloat16)
        if cfg.tie_word_embeddings:
            weights["lm_head"] = weights["embed"]
        self.mk = Megakernel(schedule, weights)
        self.mk.k_cache.normal_(generator=gen)  # a random KV history: attention reads real data
        self.mk.v_cache.normal_(generator=gen)
        self.ctx, self.reps = ctx, reps
        self.token = 7
        self.device = torch.cuda.get_device_name(0)
        self.reference = self._logits(schedule)
        self.tolerance = check_tolerance(self.mk.batch)

    def _logits(self, schedule: Schedule) -> Any:
        self.mk.set_schedule(schedule)
        return self.mk.step(*self.mk.uniform_inputs(self.token, self.ctx - 1)).float().clone()

    def check(self, schedule: Schedule) -> float:
        """Relative L2 distance of this schedule's logits from the naive schedule's (`worst_rel_l2`)."""
        return worst_rel_l2(self._logits(schedule), self.reference)

    def time(self, schedule: Schedule) -> dict[str, Any]:
        from megasynth.kernels.gpu import time_schedule

        out = time_schedule(self.mk, schedule, self.ctx, reps=self.reps)
        return {**out, "ms": out["median_ms"], "estimated": False, "source": f"GPU ({self.device})"}

    def trace(self, schedule: Schedule) -> dict[str, Any] | None:
        try:
            from megasynth.trace import schedule_sha256

            self.mk.set_schedule(schedule)
            meta = {"model": schedule.model.name if schedule.model else None,
                    "schedule_sha256": schedule_sha256(schedule.to_json())}
            return self.mk.traced_step(*self.mk.uniform_inputs(self.token, self.ctx - 1), meta)
        except Exception as exc:  # noqa: BLE001 - a trace is evidence, not a result: say why it is missing
            print(f"note: no GPU trace for the best schedule: {exc}", file=sys.stderr)
            return None


# --------------------------------------------------------------------------------------------------------------
# One candidate


def baseline_proposal() -> Proposal:
    """Candidate c0000 of every run: the naive lowering, so that speed-ups are measured side by side."""
    return Proposal(Strategy(), [], "the naive baseline: round-robin, one all-join counter per stage", "naive")


def build(spec: ModelSpec, workers: int, proposal: Proposal) -> Schedule:
    """Lower the proposal's strategy, apply its patches and stamp its provenance in meta (raises ScheduleError or
    ValueError for a proposal that does not build)."""
    schedule = lower(spec, workers, proposal.strategy, proposal.proposer or "naive")
    schedule = apply_patches(schedule, proposal.patches)
    if spec.batch > 1:  # refuse what the batch's interpreter cannot run now, not after the search
        if default_batch_interpreter(spec.config, spec.batch) == "v10":
            c = spec.config  # the default build: a QK-norm model's with qk_pairs; x in fp16 on tile slots
            check_runs_batched_on_v10(pack(schedule, "v10"), qk_pairs=c.qk_norm,
                                      x16=v10_tile_slots(c, spec.batch))
        else:
            check_runs_on_v9(pack(schedule, "v9"), spec.config.hd, "this model's batch runs on interpreter v9 "
                             "(whole-head QKV tiles, fuse_attn_reduce false, qk_norm in_qkv)")
    schedule.meta.update({"proposer": proposal.proposer or "naive", "parent": proposal.parent,
                          "rationale": proposal.rationale})
    return schedule


class Verdict:
    """A validator report carried back from a worker process as JSON (what `evaluate` reads of a `Report`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.accepted = data.get("verdict") == "accepted"

    def to_json(self) -> dict[str, Any]:
        return self.data


@dataclass
class Standing:
    """What one process knows of the search so far. The loop records every result here; the evaluator reads it to
    pre-screen (best estimate), to compute speed-ups (baseline) and to decide promotions (best), and adds each
    schedule it builds to `keys` so that a repeat costs no trial."""

    history: list[Result] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # schedule_key -> the candidate that has it
    best: Result | None = None
    best_est: float | None = None
    baseline_ms: float | None = None

    def remember(self, res: Result, est_ms: float | None) -> None:
        """Record one result: history, the best so far, the baseline's time, the best estimate."""
        self.history.append(res)
        self.results[res.candidate] = res
        if res.candidate == BASELINE:
            self.baseline_ms = res.ms
        if res.accepted and res.ms is not None and (self.best is None or res.ms < (self.best.ms or math.inf)):
            self.best = res
        if est_ms is not None and (self.best_est is None or est_ms < self.best_est):
            self.best_est = est_ms


class Evaluator:
    """Evaluates candidates of one run for one process: owns the GPU timer (created on first use) and writes every
    outcome to the run folder."""

    def __init__(self, cfg: SearchConfig, spec: ModelSpec, workers: int, gpu: bool, params: CostParams, run: RunDir,
                 standing: Standing) -> None:
        self.cfg, self.spec, self.workers, self.gpu, self.params = cfg, spec, workers, gpu, params
        self.run, self.standing = run, standing
        self.timer: GpuTimer | None = None

    def build(self, proposal: Proposal) -> Schedule:
        """The proposal's schedule for this run's model and worker count."""
        return build(self.spec, self.workers, proposal)

    def gpu_timer(self) -> GpuTimer:
        """This process's GPU timer, built on first use (weights, KV cache and the naive schedule's logits)."""
        if self.timer is None:
            self.timer = GpuTimer(self.build(baseline_proposal()), self.cfg.ctx)
        return self.timer

    def evaluate(self, cid: str, proposal: Proposal, schedule: Schedule | None = None,
                 report: Report | Verdict | None = None, failure: str | None = None) -> Result:
        """Lower, patch, validate, time or estimate one proposal and write it to the run folder. `failure`: the
        worker process preparing it died (the proposal is recorded as failed, not rebuilt here: that could take this
        process down too)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        record: dict[str, Any] = {"candidate": cid, "proposer": proposal.proposer, "parent": proposal.parent,
                                  "rationale": proposal.rationale,
                                  "strategy": proposal.strategy.model_dump(mode="json"), "patches": proposal.patches,
                                  "estimated": not self.gpu}
        if failure is not None:
            record.update(reason="worker_died", error=failure)
            self.run.save_rejected(cid, record)
            cfg.notice(f"{cid}: {failure}")
            return Result(cid, proposal, False, error=failure)
        try:
            schedule = schedule or self.build(proposal)
        except (ScheduleError, ValueError) as exc:
            record.update(reason="malformed", error=str(exc))
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, error=str(exc))
        record["schedule_key"] = key = schedule_key(schedule)
        self.standing.keys.setdefault(key, cid)
        try:
            est = estimate(schedule, cfg.ctx, self.params)
        except ValueError as exc:  # deadlock: the validator says it precisely
            est = None
            record["estimate_error"] = str(exc)
        if (self.gpu and est is not None and self.standing.best_est is not None and cid != BASELINE
                and est.makespan_ms > cfg.prescreen * self.standing.best_est):
            record.update(reason="screened", estimate_ms=est.makespan_ms,
                          error=f"estimate {est.makespan_ms:.4f} ms is over {cfg.prescreen}x the best estimate "
                          f"{self.standing.best_est:.4f} ms; not validated or timed")
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, error=record["error"], screened=est.makespan_ms)
        if report is None:
            report = verify(schedule, cid, Options(interleavings=cfg.interleavings, seed=cfg.seed))
        validation = {**report.to_json(), "interleavings": cfg.interleavings}
        if not report.accepted:
            data = _findings_json(report)
            record.update(reason="rejected", findings=data["findings"], validation=data,
                          seconds=round(time.perf_counter() - t0, 3))
            self.run.save_rejected(cid, record)
            return Result(cid, proposal, False, counterexample={"findings": data["findings"]})
        if self.gpu:
            timer = self.gpu_timer()
            try:
                err = timer.check(schedule)
                timing = timer.time(schedule) if err <= timer.tolerance else {}
            except Exception as exc:  # noqa: BLE001 - a watchdog hang or a kernel limit: keep it as evidence
                record.update(reason="gpu_error", error=f"{type(exc).__name__}: {exc}"[:2000], validation=validation)
                self.run.save_rejected(cid, record)
                cfg.notice(f"{cid}: the GPU run failed: {record['error'][:200]}")
                if isinstance(exc, GpuHangError):  # nothing more can run on this GPU: the search stops here
                    raise
                return Result(cid, proposal, False, error=record["error"])
            if not err <= timer.tolerance:
                record.update(reason="gpu_mismatch", error=f"logits differ from the naive schedule's by {err:.3g} "
                              f"(relative L2 > {timer.tolerance:g}): a kernel bug for this schedule",
                              validation=validation)
                self.run.save_rejected(cid, record)
                return Result(cid, proposal, False, error=record["error"])
            timing["check_rel_l2"] = err
        else:
            assert est is not None
            timing = {"ms": est.makespan_ms, "estimated": True, "source": f"cost model ({self.params.source})"}
        if est is not None:
            timing["estimate"] = est.summary()
            timing["estimate_ms"] = est.makespan_ms
            timing["critical_path"] = est.critical_path
        timing.update({k: record[k] for k in ("proposer", "parent", "rationale", "strategy", "patches",
                                              "schedule_key")})
        timing.update(ctx=cfg.ctx, workers=self.workers, seconds=round(time.perf_counter() - t0, 3))
        if self.standing.baseline_ms:
            timing["speedup_vs_naive"] = round(self.standing.baseline_ms / timing["ms"], 4)
        self.run.save_candidate(cid, schedule, validation, timing)
        res = Result(cid, proposal, True, timing["ms"], not self.gpu,
                     profile=_profile(est, keep_trace=False) if est is not None else None)
        if self.standing.best is None or timing["ms"] < (self.standing.best.ms or math.inf):
            full = self._promote(cid, schedule, timing, est, res)
            if full is not None:  # the full interleaving count found what the shorter replay missed: demote it
                import shutil

                data = _findings_json(full)
                record.update(reason="rejected", findings=data["findings"], validation=data)
                self.run.save_rejected(cid, record)
                shutil.rmtree(self.run.path / "candidates" / cid, ignore_errors=True)
                return Result(cid, proposal, False, counterexample={"findings": data["findings"]})
        return res

    def promote_again(self, res: Result) -> None:
        """Write best/ for an accepted candidate already on disk (a search killed between recording it and writing
        best/ left best/ behind it); re-validated with the full interleaving count like any new best."""
        schedule = self.run.load_candidate(res.candidate)
        timing = self.run.accepted()[res.candidate]
        try:
            est = estimate(schedule, self.cfg.ctx, self.params)
        except ValueError:
            est = None
        if self._promote(res.candidate, schedule, timing, est, res) is not None:
            self.cfg.notice(f"{res.candidate}: not promoted to best/ on resume (the full replay rejects it)")

    def promote_winner(self, cid: str, finals: dict[str, Any]) -> bool:
        """Put the finals' winner `cid` in best/ (`search.finals`), re-validated with the full interleaving count
        like any new best, its timing.json carrying the finals; when best/ holds it already, only add the finals.
        Returns whether best/ holds it now."""
        if self.run.annotate_best(cid, finals=finals):
            return True
        schedule = self.run.load_candidate(cid)
        timing = {**self.run.accepted()[cid], "finals": finals}
        try:
            est = estimate(schedule, self.cfg.ctx, self.params)
        except ValueError:
            est = None
        return self._promote(cid, schedule, timing, est, None, replace=True) is None \
            and self.run.best_candidate() == cid

    def _promote(self, cid: str, schedule: Schedule, timing: dict[str, Any], est: Estimate | None,
                 res: Result | None, replace: bool = False) -> Report | None:
        """A new best (`replace`: the finals' winner, whatever best/ holds): re-validate with the full interleaving
        count, then write best/. Returns the report when that re-validation rejects the candidate (it is then not
        promoted)."""
        cfg = self.cfg
        full = verify(schedule, cid, Options(interleavings=cfg.final_interleavings, seed=cfg.seed))
        if not full.accepted:
            cfg.notice(f"{cid}: accepted with {cfg.interleavings} interleavings but rejected with "
                       f"{cfg.final_interleavings}; not promoted")
            return full
        on_disk = self.run.best_ms()
        if not replace and on_disk is not None and on_disk <= timing["ms"] and self.run.has_best_schedule():
            return None  # another process sharing the run found a better one
        trace = self.timer.trace(schedule) if self.timer else (est.trace if est else None)
        validation = {**full.to_json(), "interleavings": cfg.final_interleavings}
        if not self.run.save_best(cid, schedule, validation, timing, trace, replace=replace):
            return None  # another process sharing the run promoted a better one meanwhile
        if est is not None and res is not None:
            res.profile = _profile(est, keep_trace=True)
        if self.standing.best is not None and self.standing.best.profile:
            self.standing.best.profile.pop("trace", None)
        return None


def _profile(est: Estimate, keep_trace: bool) -> dict[str, Any]:
    out: dict[str, Any] = {**est.summary(), "critical_path": est.critical_path}
    if keep_trace:
        out["trace"] = est.trace
    return out


def _findings_json(report: Report) -> dict[str, Any]:
    data = report.to_json()
    data["findings"] = data["findings"][:5]
    return data
