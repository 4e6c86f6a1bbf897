"""How long the emulated engine takes, and how much KV it holds (pure): the planner's profiles, scaled.

``--profile`` names either ``MODEL@ACCELERATOR`` (analytic roofline from the
planner's shipped data) or a measured-profile YAML file. The same objects
drive the planner and the router (``prfaas_sglang.runtime``), so a mock
deployment behaves as the plan assumes.

    prefill_s(l_uncached)      = T_prefill(l_uncached) / speedup
    kv_bytes(l_total)          = S_kv(l_total) * kv_scale        (real bytes shipped)
    kv_bytes_beyond(l, prefix) = (S_kv(l) - (S_kv(prefix) - S_kv(0))) * kv_scale
                                 (the decode worker holds ``prefix``'s pages: only the
                                 pages after it, and the whole recurrent/SWA state, ship)
    decode_step_s(bs, context) = analytic step time, or the measured T_decode, / speedup
    kv_pool_tokens             = (HBM * mem_fraction - weights) / full-attention KV per token
                                 (analytic; a measured profile: BS_max * 32K)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.analytic import Accelerator, AnalyticPrefill, ModelConfig, decode_step_s
from prfaas_sglang.plan.profiles import DecodeProfile, PrefillProfile
from prfaas_sglang.plan.scenario import Catalog, measured_state, parse_measured_profile

MEASURED_POOL_TOKENS_PER_SEQ = 32_768


@dataclass(frozen=True)
class EngineTiming:
    prefill: PrefillProfile
    speedup: float
    kv_scale: float
    max_batch: int
    hybrid: bool
    model: ModelConfig | None = None
    accel: Accelerator | None = None
    measured_decode: DecodeProfile | None = None

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill.prefill_s(max(uncached_tokens, 1)) / self.speedup

    def kv_bytes(self, total_tokens: int) -> int:
        return max(int(self.prefill.kv_bytes(total_tokens) * self.kv_scale), 64)

    def kv_bytes_beyond(self, total_tokens: int, prefix_tokens: int) -> int:
        """Bytes shipped when the receiver already holds the first ``prefix_tokens`` (page-aligned).

        ``S_kv(0)`` is the per-request state that does not grow with length (a hybrid model's
        linear-attention state); it is the state at the prompt's end, so it always ships."""
        if not 0 <= prefix_tokens <= total_tokens:
            raise ValueError(f"prefix_tokens must be in 0..{total_tokens}, got {prefix_tokens}")
        if prefix_tokens == 0:
            return self.kv_bytes(total_tokens)
        held = self.prefill.kv_bytes(prefix_tokens) - self.prefill.kv_bytes(0)
        return max(int((self.prefill.kv_bytes(total_tokens) - held) * self.kv_scale), 64)

    def decode_step_s(self, batch: int, mean_context_tokens: float) -> float:
        if self.measured_decode is not None:
            return self.measured_decode.step_s / self.speedup
        return decode_step_s(self.model, self.accel, batch, mean_context_tokens) / self.speedup

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens of KV one instance holds next to its weights (the decode pool)."""
        if self.model is None or self.accel is None:
            return self.max_batch * MEASURED_POOL_TOKENS_PER_SEQ
        free = self.accel.gpus * self.accel.hbm_gb * 1e9 * self.accel.mem_fraction
        free -= self.model.total_params_b * 1e9 * self.model.weight_bytes_per_param
        per_token = self.model.full_attention.kv_elems_per_token() * self.model.kv_dtype_bytes
        return max(int(free / per_token), 1)


DECODE_MAX_DEBT_S = 0.05  # wall: how far behind its schedule a decode loop may run and still catch up


@dataclass
class Pacer:
    """Steps on a schedule (pure: the time comes in): each step is due ``step_s`` after the previous one was
    due, not after it woke. A sleep that wakes late, or the work between two steps, is then repaid by
    shorter sleeps after it instead of adding to every step, so a stream's mean time between tokens is the
    truth's, not the truth's plus what the machine running the emulation adds per step. A loop more than
    ``max_debt_s`` behind starts a new schedule from now (the machine cannot keep up: the lag is kept, and
    shows in the engine's timing error); so does the first step after :meth:`rest`.

    ``started_s``: when the current step began on the schedule (its predecessor's due time, or now).
    ``slip_s``: what the schedule lost at this step (how far behind it was when a new one started from now;
    0 while it keeps up), so a step's intended time plus its slip is what its tokens' cadence took. A wake-up's
    own lateness is not a slip: the schedule repays it (epoll wakes on whole milliseconds, so every 2.25 ms
    sleep of a decode at speedup 4 woke 34% late while the cadence held within 0.1%, 2026-12-02)."""

    max_debt_s: float
    started_s: float = 0.0
    slip_s: float = 0.0
    _due_s: float | None = field(default=None, repr=False)

    def delay_s(self, step_s: float, now_s: float) -> float:
        """How long to sleep from ``now_s`` so that a step of ``step_s`` ends when it is due."""
        behind = self._due_s is None or now_s - self._due_s > self.max_debt_s
        self.slip_s = now_s - self._due_s if behind and self._due_s is not None else 0.0
        self.started_s = now_s if behind else self._due_s
        self._due_s = self.started_s + step_s
        return max(self._due_s - now_s, 0.0)

    def rest(self) -> None:
        """The loop idles: the next step starts a new schedule."""
        self._due_s = None


def load_timing(profile: str, speedup: float, kv_scale: float, max_batch: int | None,
                catalog: Catalog | None = None) -> EngineTiming:
    """``MODEL@ACCEL`` or a measured profile file; ``max_batch`` None: 256 (analytic) or the profile's BS_max."""
    if not speedup > 0:
        raise ConfigError("--speedup", f"must be > 0, got {speedup!r}")
    if not 0 < kv_scale <= 1:
        raise ConfigError("--kv-scale", f"must be in (0, 1], got {kv_scale!r}")
    if max_batch is not None and max_batch < 1:
        raise ConfigError("--max-batch", f"must be >= 1, got {max_batch!r}")
    catalog = catalog or Catalog()
    if "@" in profile and not Path(profile).is_file():
        model_ref, accel_ref = profile.split("@", 1)
        model = catalog.model(model_ref, "--profile")
        accel = catalog.accelerator(accel_ref, "--profile")
        hybrid = model.recurrent is not None or model.sliding_window is not None
        return EngineTiming(AnalyticPrefill(model, accel), speedup, kv_scale, max_batch or 256, hybrid, model, accel)
    path = Path(profile)
    if not path.is_file():
        raise ConfigError("--profile", f"expected MODEL@ACCELERATOR or a profile file, got {profile!r}")
    import yaml

    data = yaml.safe_load(path.read_text())
    prefill, _gpus, decode = parse_measured_profile(data, "--profile")
    if decode is None:
        raise ConfigError("--profile", f"{path} has no decode section (bs_max, step_s)")
    hybrid = measured_state(data, "--profile") != "none"
    return EngineTiming(prefill, speedup, kv_scale, max_batch or int(decode.bs_max), hybrid, measured_decode=decode)
