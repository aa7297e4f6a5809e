"""A model process keeps the memory it frees (`inference.heap`): the same copies, made again
after their arrays were freed, land on pages already touched instead of faulting in new ones.
Each case runs in a process of its own, as the heap's settings last a process's life."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A pass's worth of copies: 60 arrays of a few MB each, taken out of bigger ones, as a batch
# whose rows changed takes them out of the last pass's presents.
PROBE = """
import json, resource, sys
import numpy as np
from inference.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
presents = [np.ones((28, 3, 130, 64), np.float32) for _ in range(60)]
rows = np.arange(25)
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    copies = [p[rows] for p in presents]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del copies
print(json.dumps({"kept": kept, "faults": faults}))
"""


def probe(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
def test_copies_made_again_reuse_the_pages_their_freed_arrays_left() -> None:
    kept, default = probe("keep"), probe("default")
    assert kept["kept"] is True
    # 60 copies of 25 x 3 x 130 x 64 floats are ~150 MB, ~36,000 pages.
    pages = 60 * 25 * 3 * 130 * 64 * 4 // 4096
    by_default = default["faults"]
    assert isinstance(by_default, list) and min(by_default) > pages // 2  # every round faults
    again = kept["faults"]
    assert isinstance(again, list) and max(again[1:]) < pages // 100  # the first round only
