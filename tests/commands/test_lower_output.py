"""`synth lower -o FILE` writes what the name says: gzip when it ends in `.gz` (which `validate` and the schedule
readers take), plain JSON otherwise, atomically (no temporary file left, nothing half-written); a path it cannot
write exits 2 with one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from click.testing import CliRunner

from megasynth.cli import main
from megasynth.validator.cli import main as validate_main


def _lower(out: Path) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["lower", "--model", "tiny", "--batch", "2", "-o", str(out)])
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def test_lower_writes_gzip_for_a_gz_name(tmp_path: Path) -> None:
    from megasynth.ir.schedule import load_schedule

    code, out = _lower(tmp_path / "s.json.gz")
    assert code == 0, out
    data = (tmp_path / "s.json.gz").read_bytes()
    assert data[:2] == b"\x1f\x8b", data[:20]
    code, out = _lower(tmp_path / "s.json")
    assert code == 0, out
    plain = (tmp_path / "s.json").read_bytes()
    assert plain[:1] == b"{"
    assert json.loads(gzip.decompress(data)) == json.loads(plain)
    assert load_schedule(tmp_path / "s.json.gz").to_json() == load_schedule(tmp_path / "s.json").to_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.json.gz"]  # no temporary file left
    res = CliRunner().invoke(validate_main, [str(tmp_path / "s.json.gz")])
    assert res.exit_code == 0 and "ACCEPTED" in res.output, res.output


def test_lower_to_an_unwritable_path_exits_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    code, out = _lower(tmp_path / "file" / "s.json.gz")
    assert code == 2 and f"{tmp_path / 'file' / 's.json.gz'}: cannot write" in out, out
