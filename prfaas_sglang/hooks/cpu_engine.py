"""Hooks for SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) where a release takes a CUDA-only path.

``sender_host_indices_off``: SGLang 0.5.23's prefill hands a Mooncake sender its page indices through
pinned host memory and a CUDA event (``disaggregation/prefill.py`` ``_send_kv_chunk``, taken for every
sender whose class says ``supports_host_tensor_indices``) with no device check, so the first KV send of
a disaggregated CPU server fails ("Found no NVIDIA driver"). Off, the scheduler computes the indices on
the host as it does for every other sender (``kv_to_page_indices``): the same pages, no CUDA.
"""

from __future__ import annotations


def sender_host_indices_off(result, sender, *args, **kwargs) -> None:
    """AFTER hook on ``MooncakeKVSender.__init__``: under SGLang's CPU engine, this sender takes the
    scheduler's host index path (see the module docstring); elsewhere nothing changes."""
    from sglang.srt.utils import is_cpu

    if is_cpu():
        sender.supports_host_tensor_indices = False
    return None
