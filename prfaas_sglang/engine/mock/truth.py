"""What an emulated engine really takes, apart from the topology's cost model (pure).

The topology's profile is what the *router* believes (``runtime.from_topology``). A
real engine never runs exactly at its profile: a deployment is faster or slower
than the model predicts (kernels, clocks, the model's own approximations), and
each request varies around that. :class:`ServiceTruth` gives the emulated engine
such a truth, so that a router is judged on what it learns from what workers
report, never on an oracle::

    prefill piece   = profile cost x prefill_bias x noise(request)
    decode step     = profile step x decode_bias  x noise(step)
    noise           = exp(N(-sigma^2 / 2, sigma^2))        log-normal, mean 1

The noise has mean one, so ``*_bias`` is the mean factor. Draws come from one
``random.Random(seed)`` per engine, in the order requests and steps occur.

The truth lives here, in the emulated engine's package, and reaches an engine
only through its command line (``--prefill-bias``, ``--decode-bias``,
``--noise-sigma``, ``--noise-seed``). The engine does not report it (not in
``/server_info``, not in ``/metrics``), and the router never imports the
engine (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from prfaas_sglang.errors import ConfigError

MAX_BIAS = 10.0


@dataclass
class ServiceTruth:
    prefill_bias: float = 1.0
    decode_bias: float = 1.0
    noise_sigma: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, value in (("--prefill-bias", self.prefill_bias), ("--decode-bias", self.decode_bias)):
            if not 1.0 / MAX_BIAS <= value <= MAX_BIAS:
                raise ConfigError(name, f"must be in [{1 / MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
        if not 0.0 <= self.noise_sigma <= 2.0:
            raise ConfigError("--noise-sigma", f"must be in [0, 2], got {self.noise_sigma!r}")
        self._rng = random.Random(self.seed)

    @property
    def exact(self) -> bool:
        """The engine runs exactly at its profile (no bias, no noise)."""
        return self.prefill_bias == 1.0 and self.decode_bias == 1.0 and self.noise_sigma == 0.0

    def _noise(self) -> float:
        if self.noise_sigma == 0.0:
            return 1.0
        sigma = self.noise_sigma
        return math.exp(self._rng.gauss(-sigma * sigma / 2.0, sigma))

    def prefill_factor(self) -> float:
        """The factor of one request's prefill cost (drawn once per request)."""
        return self.prefill_bias * self._noise()

    def decode_factor(self) -> float:
        """The factor of one decode step (drawn once per step)."""
        return self.decode_bias * self._noise()
