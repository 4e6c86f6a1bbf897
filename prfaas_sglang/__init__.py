"""prfaas-sglang: Prefill-as-a-Service on a pinned SGLang.

Not a fork of the SGLang tree: the pinned upstream release, a quilt-style
series of small seam patches (``patches/``), and this package, loaded into
SGLang through its ``sglang.srt.plugins`` entry point.

Importing this package imports nothing from SGLang; the modules that touch it
(``plugin``, ``hooks/``, the patch tooling) import it lazily.

Layout, by dependency direction (adapters -> pure core, never back;
``tests/unit/test_layering.py`` keeps it so):

* pure core: ``plan/`` (throughput model, planner), ``runtime`` (the scheduler's
  model of one topology), ``router/{policy,threshold,link,workers,service,metrics}``,
  ``kvindex/{index,feed}``, ``wire/`` (every message format), ``topology``, ``roles``,
  ``protocol``, ``transport/meter``;
* adapters: ``router/server`` and ``router/__main__`` (HTTP), ``adapters/zmq``
  (the one ZMQ publisher and subscriber), ``tokenizer`` (Hugging Face),
  ``engine/mock`` (the emulated worker), ``launch`` (exec), ``plugin``/``hooks``
  (SGLang), ``demo``, ``bench``.
"""

from prfaas_sglang._pin import PINNED_SGLANG_VERSION

__version__ = "0.1.0"
__all__ = ["PINNED_SGLANG_VERSION", "__version__"]
