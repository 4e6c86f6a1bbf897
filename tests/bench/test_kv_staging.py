"""``bench kv-staging``: SGLang's Mooncake path across an emulated WAN link between namespaces, every mode."""

from __future__ import annotations

import pytest

from prfaas_sglang.bench import kv_staging


@pytest.mark.slow
def test_every_mode_lands_the_kv_intact_and_staging_takes_the_writes_down_to_one_per_buffer_and_chunk(tmp_path):
    from prfaas_sglang.transport.linkem import unavailable

    assert unavailable() is None, unavailable()  # this project's machines and CI run as root with a compiler
    out = kv_staging.run(rate_mbit=400, rtt_ms=4, requests=1, repeats=1, layers=2, request_pages=512, mean_run=16,
                         chunks=2, staging_mib=64, log_dir=tmp_path)
    modes = out["modes"]
    for mode in kv_staging.MODES:
        assert modes[mode]["requests"] == 1 and modes[mode]["failed"] == 0 and modes[mode]["kv_intact"], mode
    buffers_times_chunks = 2 * 2 * 2
    assert modes["both-staged"]["writes_per_request"] == buffers_times_chunks
    assert modes["contiguous"]["writes_per_request"] == buffers_times_chunks  # the fresh pool's count
    # scattered pages: a write per run contiguous on both sides, then per destination run, then per buffer
    assert modes["adjacent"]["writes_per_request"] > modes["prefill-staged"]["writes_per_request"] > buffers_times_chunks
