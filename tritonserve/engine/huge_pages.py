"""The weights a decode step streams, gathered into one buffer on transparent huge pages.

A batch-1 step reads every packed weight once. On the heap's 4 KiB pages the read crosses a
page every 4 KiB: a TLB miss, and the hardware prefetcher's stream stops at the boundary. In a
C++ loop of SmolLM2's 30 x 4 Q4_1 layer matmuls (66 MB, 2 threads, one process alternating
two copies, Zen 4): 2.14-2.40 ms a pass on 2 MiB pages against 2.54-2.93 ms on 4 KiB pages.

`gather(tensors)` copies the tensors into one fresh anonymous mapping advised MADV_HUGEPAGE
before its first touch (Linux; THP "madvise" or "always") and returns views in the same order.
Where the advice is refused (another OS, THP "never") the views are plain memory and nothing
else changes.
"""
from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger("tritonserve.engine")

HUGE_PAGE = 2 << 20
ALIGN = 64  # each view starts on a cache line (the C++ panels load 64-byte lines)


def _arena(length: int) -> tuple[torch.Tensor, bool]:
    """`length` bytes of fresh anonymous memory (not yet touched) and whether the advice was
    taken. A malloc'd buffer may reuse heap pages already faulted in on 4 KiB pages (a GGUF
    parse frees ~100 MB before the weights are gathered), so the arena is its own mapping."""
    buffer = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError:
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8), advised  # the tensor keeps it mapped


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU tensors -> copies in one buffer on huge pages where the OS grants them (views in the
    same order, same dtype and shape); an empty list as it is."""
    if not tensors:
        return []
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    total = sum(sizes)
    arena, advised = _arena(-(-total // HUGE_PAGE) * HUGE_PAGE)
    if not advised:
        log.info("huge pages not granted for %.1f MB of weights", total / 1e6)
    views, offset = [], -arena.data_ptr() % HUGE_PAGE
    for t, size in zip(tensors, sizes):
        nbytes = t.numel() * t.element_size()
        view = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += size
    return views


def huge_page_bytes(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` (from /proc/self/smaps), None where it
    cannot be read: how a test sees the advice taken."""
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
