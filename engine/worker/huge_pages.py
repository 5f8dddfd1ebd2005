"""Transparent huge pages for the CPU KV pool.

Why: a decode step's attention reads every running sequence's K/V blocks, a few KB each, scattered over
a pool of hundreds of MB. With 4 KB pages nearly every block costs TLB misses, and the kernel's
prefetches wait on page walks. Asking Linux for 2 MB pages (madvise MADV_HUGEPAGE, honoured where
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always`) before the pool is first touched
halved the attention's time: 64 sequences of 176 tokens, 30 layers' pools (250 MB of bf16 K/V), 2
threads, AMX Xeon, 1287-1322 -> 682-685 us per layer (docs/benchmark-log.md).

TOKENMILL_HUGE_PAGES=0 leaves the pool on normal pages, for A/B runs.
"""

import ctypes
import os
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 1 << 21


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MB pages of t's memory; True if Linux took the advice. Only
    pages first touched after this call get them, so call it on a fresh torch.empty."""
    if os.environ.get("TOKENMILL_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, last - first, MADV_HUGEPAGE) == 0


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on the CPU, advised onto huge pages before the zeros touch it."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
