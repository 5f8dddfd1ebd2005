"""The CPU KV pool is advised onto transparent huge pages (engine/worker/huge_pages.py): where Linux offers them
for madvise, the pool's memory must really be backed by 2 MB pages, and the switch must turn that off."""

import pathlib

import pytest
import torch
from tokenmill.engine.worker.huge_pages import zeros_huge_pages

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    text = THP.read_text() if THP.exists() else ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else "unavailable"


def anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings t's memory overlaps (/proc/self/smaps; madvise splits a mapping at
    the advised range's ends)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    inside, kb = False, 0
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            kb += int(line.split()[1])
    return kb


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason=f"transparent huge pages: {thp_mode()}")
def test_the_pool_sits_on_huge_pages_and_the_switch_turns_them_off(monkeypatch) -> None:
    pool = zeros_huge_pages((64, 1 << 20), torch.bfloat16)  # 128 MB
    assert pool.abs().sum().item() == 0
    # Everything but the unaligned ends: 126 MB of whole 2 MB pages, less what the kernel could not find.
    assert anon_huge_kb(pool) >= 64 * 1024, anon_huge_kb(pool)
    if thp_mode() == "madvise":  # under "always" every large mapping gets them anyway
        monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
        plain = zeros_huge_pages((64, 1 << 20), torch.bfloat16)
        assert anon_huge_kb(plain) == 0

