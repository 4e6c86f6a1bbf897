"""Benchmarks whose numbers go into BENCHMARKS.md: ``python -m prfaas_sglang.bench --help``.

Each subcommand lives in the module that registers it (its ``SUBCOMMANDS``: :mod:`.subcommands`);
``__main__``'s ``COMMANDS`` says which: mostly the module of the same name; ``compare`` is
``capacity``'s (over ``compare``'s own flags), ``mock-fidelity`` is ``mock``'s,
``router-overhead`` and ``router-gc`` are ``router``'s, ``layerwise`` is
``layerwise_bench``'s, and ``gpu-bundle``, ``gpu-e2e``, ``profile`` and ``predict`` are
:mod:`prfaas_sglang.gpu.cli`'s. Beside them: ``capacity_rows`` and ``slo`` (what ``compare --capacity``
compares and how it scores, pure), ``sim_vs_emulator`` (``sim --study emulator``), ``sglang_cpu``
(SGLang's pools and caches on CPU, for benchmarks and tests), ``dashboard_png`` and ``prometheus``
(what ``dashboard`` draws with and queries), and the other ends a benchmark runs in a subprocess or a
namespace (``transport_peer``, ``kv_staging_peer``, ``mock_kv_client``).
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ("capacity_rows", "slo")
