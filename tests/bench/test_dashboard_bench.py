"""``bench dashboard`` end to end at its smallest setting: an emulated deployment with a kv-index, a real
Prometheus scraping it, two seconds of token-id traffic (no tokenizer anywhere), the dashboard drawn."""

from __future__ import annotations

import shutil

import pytest

from prfaas_sglang.bench import dashboard
from prfaas_sglang.bench.prometheus import BINARY


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(BINARY) is None, reason=f"{BINARY} is not installed (scripts/setup-env.sh)")
def test_a_short_run_is_drawn_from_prometheus_with_every_request_answered(tmp_path):
    result = dashboard.run(duration_s=2.0, rate=1.0, out_png=tmp_path / "dashboard.png", tokenizer=None)
    assert result["requests"] > 0 and result["failed"] == 0, result
    assert result["points"] >= 2 and (tmp_path / "dashboard.png").stat().st_size > 0
