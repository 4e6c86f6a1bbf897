"""Freezing a server's start-up objects (procgc.py): collections then skip them, later objects are collected as usual."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json
from prfaas_sglang.procgc import freeze_startup_objects, gc_status
startup = [[i] for i in range(50_000)]  # alive at start-up: frozen
frozen = freeze_startup_objects()
tracked_after_freeze = len(gc.get_objects())
class Node:
    pass
gc.disable()  # so the explicit collection below is the one that finds them
for _ in range(1000):  # cyclic garbage made later: still collected
    a, b = Node(), Node()
    a.other, b.other = b, a
del a, b
collected = gc.collect()
print(json.dumps({"frozen": frozen, "tracked_after_freeze": tracked_after_freeze, "collected": collected,
                  "status": gc_status(), "startup_alive": len(startup)}))
"""


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout)
    assert out["frozen"] >= 50_000 and out["status"]["frozen_objects"] == out["frozen"]
    assert out["tracked_after_freeze"] < 100  # nothing left for a collection to walk
    assert out["collected"] >= 2000  # the later cycles (two nodes and their __dict__s each)
    assert len(out["status"]["collections"]) == 3 and out["startup_alive"] == 50_000
