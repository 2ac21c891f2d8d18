"""Paged KV-cache block manager: O(1) allocate and free, ref counts, prefix caching.

Blocks live in a free queue ordered least-recently-freed first. A freed block keeps its
prefix-cache entry until it is handed out again, so a later request with the same prefix can
take it back (a hit); allocation always takes from the head of the queue, which evicts the
least recently used cached block.

With a disk tier (engine/disk_cache.py, --prefix-cache-dir) every newly registered block is
also handed to its writer, pinned (an extra reference) until its file is written, and a
waiting request's next blocks are read back from disk into free blocks before its lookup.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .disk_cache import DiskPrefixCache
from .request import Request

_ROOT = b"\0" * 32  # the parent digest of a prompt's first block


@dataclass(frozen=True)
class BlockKey:
    """What a full block holds: its parent's digest and its own tokens. A hit compares the
    whole key, so it is confirmed by content, never by the digest alone."""

    parent_hash: bytes | None
    tokens: tuple[int, ...]

    @property
    def digest(self) -> bytes:
        """sha256 over (parent digest, tokens as int64): chained, so a block's digest names
        its whole prefix. A 256-bit hash cannot be collided by a crafted prompt, unlike
        Python's hash() (vLLM moved to sha256 after CVE-2025-25183)."""
        h = hashlib.sha256(self.parent_hash or _ROOT)
        h.update(array("q", self.tokens).tobytes())
        return h.digest()


def prompt_digests(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained digests of the full blocks a prompt's prefix-cache lookup may hit (its
    last token is never served from the cache): what server/router.py matches against the
    digests an engine reports holding."""
    digests: list[bytes] = []
    parent: bytes | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = BlockKey(parent, tuple(token_ids[i * block_size:(i + 1) * block_size])).digest
        digests.append(parent)
    return digests


def _salt(request: Request) -> bytes | None:
    """The root of a request's chain: its LoRA adapter's (engine/lora.py), so an adapter's
    blocks are never the base model's or another adapter's."""
    return request.lora.cache_salt if request.lora is not None else None


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    disk_read_tokens: int = 0  # of hit_tokens (and later hits), read back from the disk tier


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 disk: DiskPrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block digest -> block id
        self.stats = PrefixCacheStats()
        # When a list: each digest entering (True) or leaving (False) the prefix cache, in
        # order, for take_journal() (a data-parallel engine reports them to the router).
        self.journal: list[tuple[bool, bytes]] | None = None
        self.disk = disk if enable_prefix_caching else None
        self._unsaved: list[tuple[bytes, BlockKey, int]] = []  # registered, not yet handed over
        self._disk_pins = 0
        self._reading: dict[int, str] = {}  # id of a list handed to disk.fetch -> request id
        # blocks pinned for the writer at most: past it new blocks are not written (a backlog
        # must not take the cache from the requests)
        self.max_disk_pins = max(1, num_blocks // 4)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by live requests (free cached blocks are not counted)."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of the request's tokens already in the cache. The last token is
        never served from the cache: its logits are needed; nor is any token of a prompt
        whose logprobs are asked for (SamplingParams.prompt_logprobs) or that a mean or cls
        pool reads (engine/pooling.py)."""
        if not self._may_hit(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        parent = _salt(request)
        for i in range(max_blocks):
            key = BlockKey(parent, tuple(request.token_ids[i * self.block_size:
                                                          (i + 1) * self.block_size]))
            block_hash = key.digest
            block = self._cached.get(block_hash)
            if block is None or self._block_key[block] != key:
                break
            hits.append(block)
            parent = block_hash
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += len(hits) * self.block_size
        return hits

    def _may_hit(self, request: Request) -> bool:
        params = request.params
        return self.enable_prefix_caching and params.prompt_logprobs is None \
            and params.pooling not in ("mean", "cls")

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks under their chained hashes."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for i in range(request.num_cached_blocks, num_full):
            parent = request.block_hashes[i - 1] if i else _salt(request)
            key = BlockKey(parent, tuple(request.token_ids[i * self.block_size:
                                                          (i + 1) * self.block_size]))
            block_hash = key.digest
            block = request.block_ids[i]
            request.block_hashes.append(block_hash)
            if self._block_hash[block] is None and block_hash not in self._cached:
                self._block_hash[block] = block_hash
                self._block_key[block] = key
                self._cached[block_hash] = block
                if self.journal is not None:
                    self.journal.append((True, block_hash))
                # an adapter's chain is keyed by its name, which a restart may give another
                # adapter: only the base model's blocks go to disk
                if self.disk is not None and request.lora is None \
                        and not self.disk.has(block_hash):
                    self._unsaved.append((block_hash, key, block))
        request.num_cached_blocks = num_full

    # ---- the disk tier -------------------------------------------------------------------
    def write_behind(self) -> None:
        """Hand the blocks registered since the last call to the disk writer (the end of a
        step), each pinned until written."""
        if not self._unsaved:
            return
        room = max(0, self.max_disk_pins - self._disk_pins)
        batch = [item for item in self._unsaved[:room] if self._block_hash[item[2]] == item[0]]
        self._unsaved.clear()
        for _, _, block in batch:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        self._disk_pins += len(batch)
        self.disk.save(batch)

    @property
    def reading(self) -> bool:
        """A read from the disk tier is in flight (a request waits for it)."""
        return bool(self._reading)

    def settle_disk(self, wait_s: float = 0.0, drain: bool = False) -> None:
        """Unpin the blocks the writer is done with, and register those the reader brought
        (the start of a step). wait_s: wait that long for a read in flight (a step with
        nothing else to do); drain: for every write and read (flush, close)."""
        if self.disk is None:
            return
        if drain:
            self.disk.drain()
        for block in self.disk.written():
            self._disk_pins -= 1
            self._unpin(block)
        for items, read in self.disk.fetched(wait_s if self._reading else 0.0):
            self._reading.pop(id(items), None)
            for n, (digest, key, block) in enumerate(items):
                self._unpin(block)
                if n >= read or digest in self._cached:  # not read, or computed meanwhile
                    if self._ref_counts[block] == 0:
                        self._free.move_to_end(block, last=False)  # first to be taken
                    continue
                self._block_hash[block], self._block_key[block] = digest, key
                self._cached[digest] = block
                if self.journal is not None:
                    self.journal.append((True, digest))
            self.stats.disk_read_tokens += read * self.block_size

    def _unpin(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None

    def read_from_disk(self, request: Request) -> bool:
        """Start reading the request's next prefix blocks that the disk tier holds into free
        blocks (pinned; registered as cached once read: settle_disk), so that
        find_cached_prefix hits them. Its blocks already in memory move to the free queue's
        tail first, so a read never evicts its own chain. False while a read for it is in
        flight (the request waits; the queue behind it too); True when nothing (more) is to
        be read."""
        if self.disk is None or request.lora is not None or not self._may_hit(request):
            return True
        if any(rid == request.request_id for rid in self._reading.values()):
            return False
        parent: bytes | None = None
        chain: set[int] = set()
        wanted: list[tuple[bytes, BlockKey]] = []
        for i in range((request.num_tokens - 1) // self.block_size):
            key = BlockKey(parent, tuple(request.token_ids[i * self.block_size:
                                                          (i + 1) * self.block_size]))
            parent = key.digest
            block = self._cached.get(parent)
            if block is not None and self._block_key[block] == key:
                chain.add(block)
                if self._ref_counts[block] == 0:
                    self._free.move_to_end(block)
            elif len(wanted) < self.disk.blocks_per_read and self.disk.has(parent):
                wanted.append((parent, key))
            else:
                break
        items = []
        for digest, key in wanted:
            if not self._free or next(iter(self._free)) in chain:
                break
            block = self._take_free_block()  # its reference is the read's pin
            chain.add(block)
            items.append((digest, key, block))
        if not items:
            return True
        self._reading[id(items)] = request.request_id
        self.disk.fetch(items)
        return False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (SGLang's /flush_cache, vLLM's /reset_prefix_cache);
        False, and nothing forgotten, while a request holds blocks."""
        if any(self._ref_counts):
            return False
        for block, block_hash in enumerate(self._block_hash):
            if block_hash is not None and self.journal is not None:
                self.journal.append((False, block_hash))
            self._block_hash[block] = None
            self._block_key[block] = None
        self._cached.clear()
        return True

    def take_journal(self) -> list[tuple[bool, bytes]]:
        """The cache's changes since the last call (journal must be a list)."""
        changes, self.journal = self.journal, []
        return changes

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking the cached
        prefix blocks, if any). All or nothing: False changes no state."""
        cached_blocks = cached_blocks or []
        have = len(request.block_ids) + len(cached_blocks)
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - have
        reusable_free = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        if need > len(self._free) - reusable_free:
            return False
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        request.block_ids.extend(cached_blocks)
        if cached_blocks:
            request.block_hashes.extend(self._block_hash[b] for b in cached_blocks)
            request.num_cached_blocks = len(request.block_hashes)
        for _ in range(need):
            request.block_ids.append(self._take_free_block())
        return True

    def trim(self, request: Request) -> None:
        """Return the blocks past those its computed tokens need (a speculating step's
        rejected tail: engine/speculative.py). Their slots were never registered in the prefix
        cache (only full computed blocks are), and a later step writes a position before any
        step reads it, so nothing stale is ever read."""
        keep = self.blocks_needed(request.num_computed_tokens)
        while len(request.block_ids) > keep:
            block = request.block_ids.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks go to the queue first so that they are
        evicted before the shared prefix blocks."""
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
            elif self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
        request.block_ids = []
        request.block_hashes = []
        request.num_cached_blocks = 0

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old_hash = self._block_hash[block]
        if old_hash is not None:  # evict its prefix-cache entry
            del self._cached[old_hash]
            if self.journal is not None:
                self.journal.append((False, old_hash))
            self._block_hash[block] = None
            self._block_key[block] = None
        self._ref_counts[block] = 1
        return block
