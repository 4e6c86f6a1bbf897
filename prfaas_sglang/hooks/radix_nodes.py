"""Reading a node of SGLang's radix trees, either release's (0.5.15's per-kind trees, 0.5.23's unified one):
both keep a node's key (its tokens past its parent) and its parent, up to the root."""

from __future__ import annotations

from typing import Any


def prefix_len(node: Any, root: Any) -> int:
    """Tokens from the root to ``node``'s end (a walk up its parents)."""
    n = 0
    while node is not None and node is not root:
        n += len(node.key)
        node = node.parent
    return n
