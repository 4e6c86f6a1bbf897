"""A KV index's content, for a router that restarts: the kv-index service's ``GET /snapshot`` (JSON, pure).

::

    {"v": 3, "workers": {name: {"cluster": str, "block_size": int | null,
                                "blocks": [[block, depth], ...], "checkpoints": [block, ...],
                                "reports_state": bool, "swa_missing": [block, ...],
                                "swa_window_tokens": int | null}}}

``block`` is SGLang's signed 64-bit page hash (``wire/blocks.py``); ``depth`` its distance from
the root in blocks (>= 1); ``checkpoints`` the blocks where the index expects a hybrid state;
``reports_state`` whether those came from the worker's state events (wire/kv_events.py v2)
rather than inferred; ``swa_missing`` the blocks stored without their sliding-window KV and
``swa_window_tokens`` the window of a sliding-window worker (null: none; wire/kv_events.py v3).
A snapshot says what a worker held when it was taken: events after it are the subscriber's.

History:
  v1: first version.
  v2: + ``reports_state`` (a v1 snapshot decodes with it false).
  v3: + ``swa_missing``, ``swa_window_tokens`` (older snapshots decode with none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from prfaas_sglang.wire._json import json_object

SNAPSHOT_VERSION = 3
MAX_BLOCKS_PER_WORKER = 1 << 22  # 4M pages: more than any worker's KV pool holds
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class WorkerSnapshot:
    cluster: str
    block_size: int | None
    blocks: tuple[tuple[int, int], ...]  # (block, depth)
    checkpoints: tuple[int, ...]
    reports_state: bool = False
    swa_missing: tuple[int, ...] = ()
    swa_window_tokens: int | None = None


def encode(workers: dict[str, WorkerSnapshot]) -> bytes:
    return json.dumps({"v": SNAPSHOT_VERSION, "workers": {
        name: {"cluster": w.cluster, "block_size": w.block_size, "blocks": [list(b) for b in w.blocks],
               "checkpoints": list(w.checkpoints), "reports_state": w.reports_state, "swa_missing": list(w.swa_missing),
               "swa_window_tokens": w.swa_window_tokens} for name, w in workers.items()}}, separators=(",", ":")).encode()


def _block(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{what} must be a 64-bit integer, got {value!r}")
    return value


def decode(payload: bytes | str | dict) -> dict[str, WorkerSnapshot]:
    """Raise ValueError on anything that is not a valid v1 or v2 snapshot."""
    obj = json_object(payload, "kv snapshot")
    version = obj.get("v")
    if version not in (1, 2, SNAPSHOT_VERSION) or isinstance(version, bool):
        raise ValueError(f"unsupported kv snapshot version {version!r}")
    keys = ({"cluster", "block_size", "blocks", "checkpoints"} | ({"reports_state"} if version >= 2 else set())
            | ({"swa_missing", "swa_window_tokens"} if version >= 3 else set()))
    workers = obj.get("workers")
    if not isinstance(workers, dict):
        raise ValueError("workers must be an object")
    out: dict[str, WorkerSnapshot] = {}
    for name, w in workers.items():
        if not isinstance(w, dict) or set(w) != keys:
            raise ValueError(f"workers[{name!r}] must hold exactly {', '.join(sorted(keys))}")
        reports_state = w.get("reports_state", False)
        if not isinstance(reports_state, bool):
            raise ValueError(f"workers[{name!r}].reports_state must be true or false")
        size = w["block_size"]
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"workers[{name!r}].block_size must be a positive integer or null")
        if not isinstance(w["cluster"], str) or not isinstance(w["blocks"], list) or not isinstance(w["checkpoints"], list):
            raise ValueError(f"workers[{name!r}]: cluster must be a string, blocks and checkpoints lists")
        if len(w["blocks"]) > MAX_BLOCKS_PER_WORKER or len(w["checkpoints"]) > MAX_BLOCKS_PER_WORKER:
            raise ValueError(f"workers[{name!r}] lists more than {MAX_BLOCKS_PER_WORKER} blocks")
        blocks = []
        for pair in w["blocks"]:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"workers[{name!r}].blocks holds [block, depth] pairs")
            depth = pair[1]
            if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
                raise ValueError(f"workers[{name!r}]: a depth must be a positive integer, got {depth!r}")
            blocks.append((_block(pair[0], f"workers[{name!r}] block"), depth))
        checkpoints = tuple(_block(b, f"workers[{name!r}] checkpoint") for b in w["checkpoints"])
        swa_missing, window = w.get("swa_missing", []), w.get("swa_window_tokens")
        if not isinstance(swa_missing, list) or len(swa_missing) > MAX_BLOCKS_PER_WORKER:
            raise ValueError(f"workers[{name!r}].swa_missing must be a list of at most {MAX_BLOCKS_PER_WORKER} blocks")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"workers[{name!r}].swa_window_tokens must be a positive integer or null")
        out[name] = WorkerSnapshot(w["cluster"], size, tuple(blocks), checkpoints, reports_state,
                                   tuple(_block(b, f"workers[{name!r}] swa page") for b in swa_missing), window)
    return out
