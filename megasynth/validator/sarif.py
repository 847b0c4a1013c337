"""SARIF 2.1.0 output for code-scanning tools: `to_sarif(reports, malformed)` -> one run with a rule per finding
category, one result per finding (its JSON path as a logical location, the instruction's line as a best-effort
region), and each counterexample interleaving as a code flow of numbered events."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Any

from megasynth.ir.errors import ScheduleError

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
MAX_FLOW_EVENTS = 200
#: SARIF level per finding category: a proof that ran out of budget is a warning, distinct from a proven defect.
LEVELS = {"unproven": "warning"}

RULES: dict[str, tuple[str, str]] = {
    "race": ("Race", "Two conflicting accesses are not ordered in every interleaving (a < b must happen before b)."),
    "deadlock": ("Deadlock", "The unique maximal execution stalls: some instruction's waits can never be met."),
    "coverage": ("Coverage", "A logical output of a layer is produced twice or by no instruction."),
    "footprint": ("FootprintMismatch", "A declared footprint disagrees with the op catalogue's."),
    "unproven": ("Unproven", "A proof could not be completed within the z3 budget (--budget); not proven is not "
                 "accepted, but no race was shown either."),
    "malformed": ("Malformed", "Not a well-formed schedule: unreadable JSON, schema or structural defect."),
}


def _version() -> str:
    try:
        return metadata.version("megasynth")
    except metadata.PackageNotFoundError:
        return "0"


def _line_of(file: str | None, path: str | None, ids: list[int], cache: dict[str, list[str]]) -> int:
    """Best effort: the line where the blamed instruction's `"id": N` sits, else line 1."""
    if not file or not ids:
        return 1
    if file not in cache:
        try:
            cache[file] = Path(file).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            cache[file] = []
    pattern = re.compile(rf'"id"\s*:\s*{ids[-1]}\b')
    for k, line in enumerate(cache[file], 1):
        if pattern.search(line):
            return k
    return 1


def _location(file: str | None, path: str | None, line: int) -> dict[str, Any]:
    loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": file or "schedule.json"},
                                                "region": {"startLine": max(1, line)}}}
    if path:
        loc["logicalLocations"] = [{"fullyQualifiedName": path, "kind": "member"}]
    return loc


def _flow(file: str | None, line: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    locs = []
    for e in events[:MAX_FLOW_EVENTS]:
        label = f"#{e['instruction']} {e['op']}" + (f" L{e['layer']}" if e.get("layer") is not None else "")
        text = f"{e['n']}. worker {e['worker']} {e['event']} {label}"
        if "counters" in e:
            text += " -> " + ", ".join(f"c{c} = {v}" for c, v in e["counters"].items())
        loc = _location(file, None, line)
        loc["message"] = {"text": text}
        locs.append({"location": loc, "executionOrder": e["n"]})
    return {"threadFlows": [{"locations": locs}]}


def to_sarif(reports: list[Any], malformed: list[ScheduleError]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of validation reports and malformed files."""
    rule_ids = list(RULES)
    rules = [{"id": rid, "name": name, "shortDescription": {"text": text}, "fullDescription": {"text": text},
              "defaultConfiguration": {"level": LEVELS.get(rid, "error")},
              "helpUri": "https://github.com/megasynth/megasynth#validate"} for rid, (name, text) in RULES.items()]
    results: list[dict[str, Any]] = []
    artifacts: list[str] = []
    cache: dict[str, list[str]] = {}
    for report in reports:
        if report.file and report.file not in artifacts:
            artifacts.append(report.file)
        for f in report.findings:
            line = _line_of(report.file, f.path, f.instructions, cache)
            res: dict[str, Any] = {
                "ruleId": f.category, "ruleIndex": rule_ids.index(f.category) if f.category in rule_ids else 0,
                "level": LEVELS.get(f.category, "error"), "message": {"text": f.message},
                "locations": [_location(report.file, f.path, line)],
                "properties": {"instructions": f.instructions},
            }
            events = f.details.get("events")
            if events:
                res["codeFlows"] = [_flow(report.file, line, events)]
            results.append(res)
    for exc in malformed:
        if exc.file and exc.file not in artifacts:
            artifacts.append(exc.file)
        results.append({"ruleId": "malformed", "ruleIndex": rule_ids.index("malformed"), "level": "error",
                        "message": {"text": f"{exc.path}: {exc.message}"},
                        "locations": [_location(exc.file, exc.path, 1)]})
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "megasynth-validate", "version": _version(),
                            "informationUri": "https://github.com/megasynth/megasynth", "rules": rules}},
        "artifacts": [{"location": {"uri": a}} for a in artifacts],
        "invocations": [{"executionSuccessful": True}],
        "results": results,
        "properties": {"reports": [{"file": r.file, "verdict": r.verdict, "stats": r.stats,
                                    "seconds": {k: round(v, 4) for k, v in r.seconds.items()}} for r in reports]},
    }
    return {"$schema": SCHEMA_URI, "version": "2.1.0", "runs": [run]}
