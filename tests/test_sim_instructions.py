"""benchmarks/sim_instructions.py: valgrind's instruction count of one simulate call."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_instructions.py"


def test_names_the_missing_tool_and_exits_2(tmp_path):
    # a PATH with python but neither valgrind nor cc
    (tmp_path / "python").symlink_to(sys.executable)
    proc = subprocess.run([str(tmp_path / "python"), str(SCRIPT), "--requests", "10"], capture_output=True,
                          text=True, env={"PATH": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("sim_instructions.py: needs valgrind and cc on PATH "
                                   "(Debian: apt-get install valgrind gcc)")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None, reason="needs valgrind and cc")
def test_counts_more_instructions_for_more_requests():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workload", "conv", "--requests", "200", "100"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [int(r[1]) for r in rows] == [100, 200]  # sizes in order
    small, large = float(rows[0][3]), float(rows[1][3])
    assert 0 < small < large
    assert float(rows[1][4]) == pytest.approx((large - small) * 1000 / 100, rel=0.01)  # M per 1k requests
