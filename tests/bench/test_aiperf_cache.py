"""The AIPerf cross-check hands AIPerf the shipped tokenizer as a cached hub repo, read offline."""

import subprocess
import sys

import pytest

from prfaas_sglang.bench.aiperf_check import hub_cache_with_shipped_tokenizer
from prfaas_sglang.tokenizer import SHIPPED, PromptTokenizer

# A fresh interpreter, so the offline switches are read at import as in AIPerf's workers.
_LOAD = """
import sys
from huggingface_hub import snapshot_download
from transformers import AutoTokenizer
path = snapshot_download(sys.argv[1], local_files_only=True)
print(list(AutoTokenizer.from_pretrained(path)(["hello world, the same ids"])["input_ids"][0]))
"""


@pytest.mark.slow
def test_offline_hub_lookup_finds_the_shipped_tokenizer(tmp_path):
    cache, repo = hub_cache_with_shipped_tokenizer(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _LOAD, repo], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ids = PromptTokenizer.load(SHIPPED).encode_text("hello world, the same ids")
    assert out.stdout.strip().splitlines()[-1] == str(list(ids))


def test_laying_the_cache_twice_is_idempotent(tmp_path):
    first = hub_cache_with_shipped_tokenizer(tmp_path / "hub")
    second = hub_cache_with_shipped_tokenizer(tmp_path / "hub")
    assert first == second
    assert len(list((tmp_path / "hub").rglob("snapshots/*"))) == 1
