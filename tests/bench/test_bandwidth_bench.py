"""``bench bandwidth`` end to end at its smallest setting: a router and emulated workers, the PrfaaS link
behind a shaped namespace (root), 2 s clear, 3 s throttled, 2 s clear (about 15 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prfaas_sglang.demo import netns


@pytest.mark.slow
@pytest.mark.skipif(netns.available() is not None, reason=f"shaped link: {netns.available()}")
def test_a_throttled_run_reports_its_phases_every_request_and_the_routers_series(tmp_path):
    """Every request answered or refused (none failed), the phases where they were asked for, the
    router's threshold baseline and the sampled series written beside the plot."""
    series, plot = tmp_path / "series.json", tmp_path / "bandwidth.png"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "bandwidth", "--phases", "2,3,2", "--load-rps", "2",
                           "--speedup", "20", "--series", str(series), "--plot", str(plot), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["result"]
    assert result["requests"] > 0 and result["requests_failed"] == 0, result
    assert result["throttled_mbit"] == result["nominal_mbit"] / 10 and result["baseline_threshold_tokens"] > 0
    assert 2 <= result["throttled_at_s"] < result["cleared_at_s"] <= 6
    written = json.loads(series.read_text())
    assert len(written["requests_log"]) == result["requests"] and written["series"] and plot.stat().st_size > 0
