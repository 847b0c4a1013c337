"""`synth runs merge`: one run folder out of the folders of machines that worked one study without sharing runs/.

The study (its claims, `megasynth.runs.study`) says which candidates exist and what each one's outcome is; the folders
hold their files. Each done claim's files are copied from the folder whose candidate has the claim's schedule key; a
candidate no folder has is written from the study's record (timing and validation; the schedule is rebuilt from its
strategy and patches when it is read, see `RunDir.load_candidate`); a candidate of a packed folder is written out
as a folder. Files that the study does not know (a process killed in the middle of a candidate) are left out. best/
comes from the folder that promoted the fastest candidate (of candidates tied for the fastest, one a folder
promoted), and the leaderboard is rebuilt from the merged files.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasynth.atomic import write_json_atomic
from megasynth.runs.rundir import RunDir, candidate_id


@dataclass
class Merged:
    """What `merge_runs` did."""

    path: Path
    copied: dict[str, int] = field(default_factory=dict)  # source folder -> candidates copied from it
    from_study: list[str] = field(default_factory=list)  # candidates no folder had, written from the study
    left_out: list[str] = field(default_factory=list)  # candidate files the study does not have
    running: list[str] = field(default_factory=list)  # candidates still claimed (being evaluated) at merge time
    best: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def candidates(self) -> int:
        return sum(self.copied.values()) + len(self.from_study)


def _storage_of(sources: list[RunDir], storage: str | None) -> str:
    """The study's storage: `storage`, else the URL the folders' run.json names, else a study.db in one of them."""
    if storage:
        return storage
    named = {str(r.info.get("storage")) for r in sources if r.info.get("storage")}
    urls = sorted(u for u in named if "://" in u)
    if len(urls) > 1:
        from megasynth.runs.study import shown

        raise ValueError(f"the folders name different storages ({', '.join(map(shown, urls))}); pick one with "
                         "--storage")
    if urls:
        return urls[0]
    for r in sources:
        if (r.path / "study.db").is_file():
            return f"sqlite:///{(r.path / 'study.db').resolve()}"
    raise ValueError("no study to merge by: the folders name no storage URL and hold no study.db (--storage URL)")


def _same(doc: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    """True when a folder's candidate is the study's: same verdict and the same schedule (or, for a proposal that
    did not build, the same strategy and patches)."""
    if doc is None or bool(doc.get("accepted")) != bool(want.get("accepted")):
        return False
    a, b = doc.get("record") or {}, want.get("record") or {}
    if b.get("schedule_key") or a.get("schedule_key"):
        return a.get("schedule_key") == b.get("schedule_key")
    return (a.get("strategy"), a.get("patches")) == (b.get("strategy"), b.get("patches"))


def merge_runs(folders: list[Path], dest: Path, storage: str | None = None) -> Merged:
    """Merge the run folders of one study into `dest` (which must not exist or be empty). Raises ValueError (a
    `StorageError` for the storage) with a one-line reason when they cannot be merged."""
    from megasynth.runs.study import Claims, make_engine, normalize_url, shown, study_name, without_password

    sources = [RunDir(f) for f in folders]
    for r in sources:
        if not (r.path / "run.json").is_file():
            raise ValueError(f"{r.path} is not a run folder (no run.json)")
    names = sorted({r.path.name for r in sources})
    if len(names) > 1:
        raise ValueError(f"the folders are runs of different names ({', '.join(names)}): a study is one run name")
    models = sorted({str(r.info.get("model")) for r in sources})
    if len(models) > 1:
        raise ValueError(f"the folders are runs of different models ({', '.join(models)})")
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} exists and is not empty")
    url = _storage_of(sources, storage)
    claims = Claims(make_engine(normalize_url(url), url), study_name(names[0]), owner="merge")
    rows = claims.rows()
    if not rows:
        raise ValueError(f"the study of run {names[0]} in {shown(url)} has no candidates")

    out = RunDir(dest)
    dest.mkdir(parents=True, exist_ok=True)
    merged = Merged(dest, {str(r.path): 0 for r in sources})
    wanted: dict[str, dict[str, Any]] = {}
    for row in rows:
        cid = candidate_id(int(row["slot"]))
        if row["state"] != "done":
            merged.running.append(cid)
        elif not row["result"]:
            merged.notes.append(f"{cid}: the study has no record of it (made before claims, without files)")
        else:
            wanted[cid] = json.loads(row["result"])
    for cid, want in wanted.items():
        src = next((r for r in sources if _same(r.outcome(cid), want)), None)
        if src is None:
            out.save_outcome(cid, want)
            merged.from_study.append(cid)
            continue
        if want.get("accepted"):
            src.copy_candidate(cid, out)  # from its folder, or written out of a packed run's pack
        else:
            (dest / "rejected").mkdir(exist_ok=True)
            shutil.copy2(src.path / "rejected" / f"{cid}.json", dest / "rejected" / f"{cid}.json")
        merged.copied[str(src.path)] += 1
    for r in sources:
        for cid in sorted({*r.accepted(), *r.rejected()}):
            if cid not in wanted or not _same(r.outcome(cid), wanted[cid]):
                merged.left_out.append(f"{r.path}/{cid}")

    board = out.write_leaderboard()
    merged.best, holder = promoted_fastest([e for e in board["entries"] if e["accepted"]], sources, wanted)
    if holder is not None:
        shutil.copytree(holder.path / "best", dest / "best")
    elif merged.best is not None:
        merged.notes.append(f"no folder has {merged.best} (the fastest) in best/, so best/ is not written")
    write_json_atomic(dest / "run.json", {**sources[0].info, "storage": without_password(url),
                                          "merged_from": [str(r.path) for r in sources],
                                          "merged": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")})
    return merged


def promoted_fastest(ranked: list[dict[str, Any]], sources: list[RunDir], wanted: dict[str, dict[str, Any]]
                     ) -> tuple[str | None, RunDir | None]:
    """The merged run's best: of the accepted leaderboard entries tied for the fastest (`ranked`, fastest first), the
    first that a folder holds in best/ with the study's schedule key, and that folder; else, where the searches ran
    finals (`search.finals`: best/ holds their winner, not always the fastest single measurement), the fastest
    entry that a folder holds in best/ as its finals' winner; else the first of the tied and None. Ties matter: a
    search promotes only a strictly faster candidate, so of two machines that found the same time, the later one
    never wrote its own to best/."""
    if not ranked:
        return None, None
    fastest = [e["candidate"] for e in ranked if e["ms"] == ranked[0]["ms"]]
    held = [(r, _read_json(r.path / "best" / "timing.json")) for r in sources]

    def holder(cid: str, won: bool) -> RunDir | None:
        key = (wanted.get(cid, {}).get("record") or {}).get("schedule_key")
        return next((r for r, best in held if best.get("candidate") == cid and best.get("schedule_key") == key
                     and (not won or isinstance(best.get("finals"), dict))), None)

    for cid in fastest:
        if (r := holder(cid, False)) is not None:
            return cid, r
    for e in ranked:
        if (r := holder(e["candidate"], True)) is not None:
            return e["candidate"], r
    return fastest[0], None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
