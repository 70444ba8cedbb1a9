"""Trace loading: both formats, gap masking, and a clear error for every kind of bad file,
through the API and through ``undertow simulate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scheduler.planner.trace import TraceError, load_trace

DATA = Path(__file__).resolve().parents[1] / "data" / "servegen-m-small"


def _csv(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_total_csv_slice_loads() -> None:
    t = load_trace(DATA / "total_rate_4days.csv")
    assert len(t) == 576 and t.window_s == 600 and t.windows_per_day == 144
    assert np.all(np.diff(t.start_s) == 600)
    assert np.nanmin(t.rate) > 0 and not t.gaps.any()
    # No cv column: Poisson dispersion (cv = 1) means D = rate.
    assert np.allclose(t.dispersion, t.rate)


def test_client_dir_sums_rates_and_dispersion(tmp_path: Path) -> None:
    d = tmp_path / "clients"
    d.mkdir()
    (d / "chunk-1-trace.csv").write_text("0,10,2,Gamma,1,1\n600,0,,,0,0\n1200,4,1,Gamma,1,1\n")
    (d / "chunk-2-trace.csv").write_text("0,5,1,Weibull,1,1\n600,0,,,0,0\n1200,0,,,0,0\n")
    t = load_trace(d)
    assert t.rate[0] == 15 and np.isnan(t.rate[1]) and t.rate[2] == 4
    assert t.dispersion[0] == pytest.approx(2 * 2 * 10 + 1 * 1 * 5)
    assert t.gaps.tolist() == [False, True, False]


def test_real_client_slice_loads() -> None:
    t = load_trace(DATA / "clients")
    assert len(t) == 576
    assert np.nanmax(np.sqrt(t.dispersion / t.rate)) > 3  # ServeGen clients are bursty (cv >> 1)


def test_zero_windows_are_masked_as_gaps(tmp_path: Path) -> None:
    rows = "\n".join(f"{i * 600},{0 if i in (3, 4) else 100 + i}" for i in range(10))
    t = load_trace(_csv(tmp_path, "window_start_s,total_rate_rps\n" + rows + "\n"))
    assert t.gaps.tolist() == [i in (3, 4) for i in range(10)]


BAD = {
    "empty": ("", "empty"),
    "header_only": ("window_start_s,total_rate_rps\n", "no windows"),
    "missing_column": ("start,rate\n0,1\n600,2\n", "lacks"),
    "not_a_number": ("window_start_s,total_rate_rps\n0,1\n600,abc\n", ":3: total_rate_rps is 'abc'"),
    "negative": ("window_start_s,total_rate_rps\n0,1\n600,-5\n", ":3: total_rate_rps is -5; rates cannot be negative"),
    "nan": ("window_start_s,total_rate_rps\n0,1\n600,nan\n", "finite"),
    "inf": ("window_start_s,total_rate_rps\n0,1\n600,inf\n", "finite"),
    "unsorted": (
        "window_start_s,total_rate_rps\n0,1\n1200,2\n600,3\n",
        ":4: window_start_s 600 does not come after 1200",
    ),
    "duplicate": ("window_start_s,total_rate_rps\n0,1\n600,2\n600,3\n", "sorted and unique"),
    "missing_window": ("window_start_s,total_rate_rps\n0,1\n600,2\n1800,3\n", "evenly spaced"),
    "bad_window_length": ("window_start_s,total_rate_rps\n0,1\n700,2\n1400,3\n", "does not divide a day"),
    "short_row": ("window_start_s,total_rate_rps\n0,1\n600\n", "1 fields"),
    "all_zero": ("window_start_s,total_rate_rps\n0,0\n600,0\n", "every window has rate 0"),
    "mostly_gaps": ("window_start_s,total_rate_rps\n0,1\n600,0\n1200,0\n", "are gaps"),
    "negative_cv": ("window_start_s,total_rate_rps,cv\n0,1,1\n600,2,-1\n", "cv is -1"),
    "one_window": ("window_start_s,total_rate_rps\n0,1\n", "at least 2 windows"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_csv_gets_a_clear_error(tmp_path: Path, case: str) -> None:
    text, message = BAD[case]
    with pytest.raises(TraceError) as err:
        load_trace(_csv(tmp_path, text))
    assert message in str(err.value)


def test_bad_client_dirs(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no ServeGen client files"):
        load_trace(empty)
    d = tmp_path / "mismatch"
    d.mkdir()
    (d / "chunk-1-trace.csv").write_text("0,1,1,Gamma,1,1\n600,1,1,Gamma,1,1\n")
    (d / "chunk-2-trace.csv").write_text("600,1,1,Gamma,1,1\n1200,1,1,Gamma,1,1\n")
    with pytest.raises(TraceError, match="windows differ"):
        load_trace(d)
    (d / "chunk-2-trace.csv").write_text("0,1,1,Gamma\n600,1,1,Gamma\n")
    with pytest.raises(TraceError, match="expected 6"):
        load_trace(d)
    (d / "chunk-2-trace.csv").write_text("0,1,1,Gamma,1,1\n600,-1,1,Gamma,1,1\n")
    with pytest.raises(TraceError, match=r"chunk-2-trace\.csv:2: rate_rps is -1"):
        load_trace(d)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={"UNDERTOW_HOME": str(cwd / "home"), "PATH": "/usr/bin:/bin", "UNDERTOW_LOG_LEVEL": "WARNING"},
    )


def test_cli_simulate_json_and_bad_trace(tmp_path: Path) -> None:
    bad = _csv(tmp_path, BAD["unsorted"][0])
    out = _cli("simulate", "--trace", str(bad), "--json", cwd=tmp_path)
    assert out.returncode == 2
    assert "does not come after" in out.stderr and out.stdout == ""
    out = _cli("simulate", "--trace", str(DATA / "total_rate_4days.csv"), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "harvested_gpu_h",
        "oracle_gpu_h",
        "harvest_ratio",
        "fixed_window_ratio",
        "slo_violations",
        "p99_preempt_s",
        "idle_gpu_h",
    ):
        assert key in report
    assert 0 < report["harvest_ratio"] <= 1.0
