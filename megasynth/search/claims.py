"""The search's side of the study's storage (`megasynth.runs.study`): the key a proposal is claimed by, the
schedule-key step a worker process of `megasynth.search.pool` takes, and the Optuna study that records every outcome as
a trial next to the claims."""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exc as sa_exc

from megasynth.runs.study import Claims, describe, engine_kwargs, make_engine, normalize_url
from megasynth.search.proposers.base import Proposal


def proposal_key(proposal: Proposal) -> str:
    """Digest of a proposal's strategy and patches (the proposers' `strategy_key`): equal keys = the same proposal."""
    from megasynth.search.proposers.heuristic import strategy_key

    return hashlib.sha256(strategy_key(proposal.strategy, proposal.patches).encode()).hexdigest()


@dataclass(frozen=True)
class ScheduleClaim:
    """The schedule-key step of one claim, for a worker process of `megasynth.search.pool` (picklable: it opens its own
    connection). Called with the lowered schedule's key; returns the slot that already has it, or None."""

    url: str
    study: str
    owner: str
    slot: int

    def __call__(self, key: str) -> int | None:
        return _claims_for(self.url, self.study, self.owner).claim_schedule(self.slot, key)


_OPEN: dict[tuple[str, str, str], Claims] = {}


def _claims_for(url: str, study: str, owner: str) -> Claims:
    """One `Claims` per (storage, study, owner) in this process (worker processes reuse their connection)."""
    k = (url, study, owner)
    if k not in _OPEN:
        _OPEN[k] = Claims(make_engine(url), study, owner)
    return _OPEN[k]


@dataclass
class SharedStudy:
    """The Optuna study of a run and its claims, in one storage."""

    study: Any  # optuna.Study
    storage: Any  # its optuna.storages.RDBStorage
    study_id: int  # the study's id in that storage
    claims: Claims

    def add_trial(self, cid: str, doc: dict[str, Any], owner: str) -> int:
        """Record a finished candidate (its `RunDir.outcome` document) as a trial: COMPLETE with its time when it was
        accepted, else FAIL. Returns the trial's number."""
        import optuna

        rec = doc.get("record") or {}
        attrs = {"candidate": cid, "pid": owner, **{k: rec.get(k) for k in ("proposer", "rationale", "parent",
                                                                             "strategy", "patches", "schedule_key",
                                                                             "reason", "estimated")}}
        if doc.get("accepted"):
            trial = optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=float(rec["ms"]),
                                              user_attrs=attrs)
        else:
            trial = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs=attrs)
        try:
            tid = self.storage.create_new_trial(self.study_id, template_trial=trial)
            return int(self.storage.get_trial_number_from_id(tid))
        except sa_exc.SQLAlchemyError as exc:
            raise describe(self.claims.shown_as, exc) from None


def open_study(url: str, study_name: str) -> SharedStudy:
    """The Optuna study `study_name` (created if missing) and its claims, in the storage at `url`. A storage that
    cannot be reached or is not a database raises `StorageError` within the connect timeout."""
    import optuna
    from optuna.storages import RDBStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    given, url = url, normalize_url(url)
    engine = make_engine(url, given)  # fails fast, with the reason, before Optuna creates its tables
    claims = Claims(engine, study_name, shown_as=given)
    claims.create_tables()
    for attempt in range(5):
        try:
            storage = RDBStorage(url, engine_kwargs=engine_kwargs(url))
            study = optuna.create_study(study_name=study_name, storage=storage, direction="minimize",
                                        load_if_exists=True)
            return SharedStudy(study, storage, storage.get_study_id_from_name(study_name), claims)
        except sa_exc.SQLAlchemyError as exc:  # the server answered above: most likely a lost CREATE TABLE race
            if attempt == 4:
                raise describe(given, exc, "cannot set up") from None
            time.sleep(0.1 + random.random() * 0.4)
        except (ImportError, RuntimeError) as exc:
            raise describe(given, exc, "cannot set up") from None
    raise AssertionError("unreachable")
