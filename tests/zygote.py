"""This test process's SGLang zygote (:mod:`prfaas_sglang.bench.zygote`): started on first use, stopped at the
end of the session (tests/conftest.py). A probe run through :func:`run` or :func:`popen` is forked from it
instead of importing SGLang afresh (about 10 CPU-seconds each); one the zygote cannot fork runs as a plain
subprocess. Tests that share it run in one worker process when they share an ``xdist_group``."""

from __future__ import annotations

import functools

from prfaas_sglang.bench.zygote import Zygote


@functools.cache
def zygote() -> Zygote:
    return Zygote()


def run(argv, **kwargs):
    """:meth:`Zygote.run` on this process's zygote."""
    return zygote().run(argv, **kwargs)


def popen(argv, **kwargs):
    """:meth:`Zygote.popen` on this process's zygote."""
    return zygote().popen(argv, **kwargs)


def stop() -> None:
    if zygote.cache_info().currsize:
        zygote().stop()
        zygote.cache_clear()
