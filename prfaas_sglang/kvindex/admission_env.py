"""The prefix-cache settings of a prefill worker, read from its environment: one reader for the
SGLang cache backend (``hooks/hybrid_cache.py``) and the emulated engine, so both take the same
variables with the same defaults and refusals. The policy itself is pure: ``kvindex/admission.py``."""

from __future__ import annotations

from prfaas_sglang.envs import envs
from prfaas_sglang.kvindex.admission import AdmissionConfigError, PrefixAdmission

CHECKPOINT_PLACEMENTS = ("chunks", "end")


def chunk_checkpoints_from_env() -> bool:
    """``PRFAAS_STATE_CHECKPOINTS``: ``chunks`` (SGLang's: a state at every chunk boundary and at
    the end) or ``end`` (at a request's end only). A bad value raises ValueError at start-up."""
    placement = envs.STATE_CHECKPOINTS.get()
    if placement not in CHECKPOINT_PLACEMENTS:
        raise ValueError(f"PRFAAS_STATE_CHECKPOINTS must be one of {', '.join(CHECKPOINT_PLACEMENTS)}, got {placement!r}")
    return placement == "chunks"


def admission_from_env(capacity_tokens: int | None = None, capacity_states: int | None = None) -> PrefixAdmission | None:
    """``PRFAAS_PREFILL_CACHE`` (unset: None, SGLang's behaviour) for a cache of ``capacity_tokens``
    KV tokens and ``capacity_states`` state slots (None: not bounded by states), which ``auto``
    needs; a bad value raises AdmissionConfigError (a ValueError), which stops the server at start-up."""
    mode = envs.PREFILL_CACHE.get()
    if mode is None:
        return None
    raw = envs.PREFILL_CACHE_MIN_SHARED_TOKENS.get()
    try:
        min_shared = int(raw)
    except ValueError:
        raise AdmissionConfigError(f"PRFAAS_PREFILL_CACHE_MIN_SHARED_TOKENS must be an integer, got {raw!r}") from None
    return PrefixAdmission(mode, min_shared, capacity_tokens=capacity_tokens, capacity_states=capacity_states)
