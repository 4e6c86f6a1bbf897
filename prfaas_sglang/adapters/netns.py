"""Network namespaces claimed by name, so that concurrent tests and benchmarks never share one."""

from __future__ import annotations

import random
import subprocess


def claim_tag(prefix: str, tags: range) -> int | None:
    """Create namespace ``{prefix}{tag}`` for the first free tag of ``tags`` (in random order) and
    return the tag; None when every one is taken. ``ip netns add`` of a name that exists fails, so
    of two concurrent claimants only one gets a tag: what it names is that claimant's alone."""
    for tag in random.SystemRandom().sample(tags, len(tags)):
        if subprocess.run(["ip", "netns", "add", f"{prefix}{tag}"], capture_output=True).returncode == 0:
            return tag
    return None
