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


def mappings(t: torch.Tensor) -> list[dict[str, str]]:
    """The /proc/self/smaps entries of the mappings t's memory overlaps (madvise splits a mapping at the
    advised range's ends), each as {field: value}."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    found: list[dict[str, str]] = []
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
            if inside:
                found.append({})
        elif inside:
            found[-1][head.rstrip(":")] = rest.strip()
    return found


def anon_huge_kb(t: torch.Tensor) -> int:
    return sum(int(m["AnonHugePages"].split()[0]) for m in mappings(t))


def advised(t: torch.Tensor) -> bool:
    """Whether any of t's mappings carries MADV_HUGEPAGE's mark ("hg" in VmFlags)."""
    return any("hg" in m.get("VmFlags", "").split() for m in mappings(t))


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason=f"transparent huge pages: {thp_mode()}")
def test_the_pool_sits_on_huge_pages_and_the_switch_turns_them_off(monkeypatch) -> None:
    pool = zeros_huge_pages((64, 1 << 20), torch.bfloat16)  # 128 MB
    assert pool.abs().sum().item() == 0
    # Everything but the unaligned ends: 126 MB of whole 2 MB pages, less what the kernel could not find.
    assert advised(pool)
    assert anon_huge_kb(pool) >= 64 * 1024, anon_huge_kb(pool)
    # The switch withholds the advice. Whether Linux backs unadvised memory with huge pages anyway is its
    # own policy ("always"; on a CI machine in "madvise" mode the mappings under this 128 MB tensor held 256 MB), so
    # the test reads the advice itself, not the page count.
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    plain = zeros_huge_pages((64, 1 << 20), torch.bfloat16)
    assert plain.abs().sum().item() == 0
    assert not advised(plain), mappings(plain)

