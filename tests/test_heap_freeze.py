"""A serving process freezes its startup heap: garbage left by startup is collected first, what is
alive is kept out of later collections, and what serving makes afterwards is still collected.

Run in a child process: a freeze lasts as long as the process, and this one runs the other tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import gc, weakref
    import fastapi, transformers  # a router's imports: a startup heap of real size

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    from router.http.heap import freeze_startup_heap

    startup_garbage = cycle()
    frozen = freeze_startup_heap()
    assert startup_garbage() is None, "startup's garbage was frozen instead of collected"
    assert frozen == gc.get_freeze_count() > 10_000, frozen
    before = gc.get_freeze_count()
    serving_garbage = cycle()
    gc.collect()
    assert serving_garbage() is None, "garbage made after the freeze was not collected"
    assert gc.get_freeze_count() == before, "a later collection changed what is frozen"
    # a full collection now walks what serving made, not the frozen heap
    tracked = len(gc.get_objects())
    assert tracked < frozen // 10, (tracked, frozen)
    print("ok", frozen, tracked)
    """
)


def test_freeze_startup_heap_collects_startup_garbage_and_keeps_the_rest_out_of_later_collections():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
