"""The heap of a process that holds a model: memory it frees stays with it for the next pass.

A pass of the target hands back every layer's keys and values for every row (~190 MB at 32
rows of ~130 positions), and a batch whose rows changed copies them. glibc serves blocks of
that size from fresh `mmap`s and hands freed memory back to the kernel, so the next pass
touches new pages: each costs a page fault, ~1.3 us here under a virtual machine. In the
verifier's inference process at 32 streams that came to 27-60 thousand faults a wave, which
made single passes 80-215 ms slower than their neighbours (a copy of 25 rows out of 28 took 54
ms on new pages and 6 on reused ones).

`keep_freed_memory` raises glibc's thresholds so that such blocks come from the heap and a
freed one is not trimmed away: the process keeps its peak (bounded by its cache budget) and
reuses it. It is for a process that does nothing but run a model; elsewhere (another C
library, no `mallopt`) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, not from an mmap of their own: glibc's largest
# (HEAP_MAX_SIZE / 2 on 64-bit); a row's layer at 4,096 positions is 3 MB.
MMAP_THRESHOLD = 32 * 2**20
# Free memory at the top of the heap is handed back only beyond this much.
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Have this process reuse the memory it frees (glibc); True when both settings took."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no mallopt in this C library (%s): freed memory goes back as it does", name)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not taken:
        log.warning("mallopt refused the heap's thresholds: freed memory goes back as it does")
    return taken
