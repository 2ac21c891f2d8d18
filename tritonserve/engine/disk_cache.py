"""The prefix cache's second tier on disk (--prefix-cache-dir): full KV blocks written behind
the engine by one thread, read back on a miss, bounded by size with LRU, kept across restarts.

Contract with engine/kv_cache.py, its only caller (the engine's thread):
- save(items): (digest, key, block) of full computed blocks the caller has pinned (their
  K/V is never written while pinned). The writer thread copies each block out of the cache
  tensors, writes `<digest>.kv` (a temp file, then a rename: a reader never sees half a file)
  and lists the block in written(), after which the caller unpins it. save() never waits.
- has(digest): the block is in the index (files this process wrote or found at start).
- fetch(items): the reader thread reads (digest, key, block) into those blocks of the cache
  tensors, in order (the caller has pinned the blocks and registered nothing yet), and lists
  (items, how many leading ones it read) in fetched(). A file that is short, fails its
  checksum, or was written for another model, dtype or block shape (its identity differs) is
  never served: it is deleted with one log line, and the chain stops there. fetch() never
  waits either: neither a write nor a read is on a step's path.

A file: a fixed header (magic, version, identity, digest, the block's key: parent digest and
tokens, payload length, crc32), then the payload: every layer's K then V rows of the block,
[2 * layers, block_size, kv_heads, head_dim] in the cache's dtype.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("tritonserve.engine")

_MAGIC, _VERSION = b"TSKV", 1
# magic, version, has_parent, token count, payload bytes, crc32, identity, digest, parent
_HEADER = struct.Struct("<4sHHIQI32s32s32s")
# what one fetch() reads at most (the request takes what is read, then asks for more): 91
# blocks of fp32 SmolLM2 K/V, read and checked in ~100 ms on 2 cores (crc32 ~2 GB/s)
READ_BYTES_PER_CALL = 64 << 20


def cache_identity(model_path: Path, gguf: Path | None, dtype: torch.dtype, details: dict) -> bytes:
    """What a block's K/V depends on beyond its tokens: the weights (file names, sizes and
    mtimes; config.json's text), the cache dtype and shape, and `details` (quantization,
    load format, ...). Blocks of another identity live in another folder and are never read."""
    h = hashlib.sha256(b"tritonserve-kv-identity\0")
    files = [gguf] if gguf is not None else sorted(
        p for p in model_path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    for path in files:
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    config = model_path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    h.update(json.dumps({"dtype": str(dtype), **details}, sort_keys=True).encode())
    return h.digest()


class DiskPrefixCache:
    def __init__(self, folder: str | Path, max_bytes: int, identity: bytes,
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.identity = identity
        self.folder = Path(folder) / identity.hex()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.caches = caches
        k = caches[0][0]
        self.block_shape = (2 * len(caches),) + tuple(k.shape[1:])
        self.dtype = k.dtype
        self.payload_bytes = k[0].numel() * k.element_size() * 2 * len(caches)
        self.blocks_per_read = max(1, READ_BYTES_PER_CALL // self.payload_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # digest -> file bytes, LRU first
        self.total_bytes = 0
        self._scan()
        self.errors = 0
        self._jobs: queue.Queue = queue.Queue()  # lists of blocks to write
        self._written: queue.SimpleQueue = queue.SimpleQueue()
        self._reads: queue.Queue = queue.Queue()  # lists of blocks to read
        self._fetched: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, args=args, name=name, daemon=True)
                         for name, args in (("kv-disk-writer", (self._jobs, self._write)),
                                            ("kv-disk-reader", (self._reads, self._read_all)))]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def describe(self) -> str:
        return (f"prefix cache dir {self.folder}: {len(self._index)} blocks "
                f"({self.total_bytes / 2**30:.2f} of {self.max_bytes / 2**30:.2f} GiB)")

    # ---- the index ---------------------------------------------------------------------
    def _path(self, digest: bytes) -> Path:
        return self.folder / f"{digest.hex()}.kv"

    def _scan(self) -> None:
        """The files an earlier run left, oldest modified first (a hit touches its file, so
        the LRU order survives a restart); temp files an hour old are removed (younger ones
        may be another engine process's writes: data-parallel engines share the folder)."""
        found = []
        now = time.time()
        for entry in os.scandir(self.folder):
            name = entry.name
            if name.endswith(".tmp"):
                try:
                    if now - entry.stat().st_mtime > 3600:
                        _unlink(entry.path)
                except OSError:
                    pass
            elif name.endswith(".kv") and len(name) == 67:
                try:
                    st = entry.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(name[:64]), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, digest, size in sorted(found):
            self._index[digest] = size
            self.total_bytes += size
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used files until the folder fits max_bytes (lock held)."""
        while self.total_bytes > self.max_bytes and self._index:
            digest, size = self._index.popitem(last=False)
            self.total_bytes -= size
            _unlink(self._path(digest))

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self.total_bytes -= size

    def has(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    def __len__(self) -> int:
        return len(self._index)

    # ---- reading (the reader thread) ---------------------------------------------------
    def fetch(self, items: list[tuple[bytes, object, int]]) -> None:
        if items:
            self._reads.put(items)

    def fetched(self, wait_s: float = 0.0) -> list[tuple[list, int]]:
        """Reads finished since the last call: (items, how many leading ones were read);
        wait_s: wait that long for the first when none has finished."""
        if wait_s > 0:
            try:
                return [self._fetched.get(timeout=wait_s), *_take_all(self._fetched)]
            except queue.Empty:
                return []
        return _take_all(self._fetched)

    def _read_all(self, items: list[tuple[bytes, object, int]]) -> None:
        read = 0
        try:
            read = self.load(items)
        finally:
            self._fetched.put((items, read))

    def load(self, items: list[tuple[bytes, object, int]]) -> int:
        """Read the blocks into the cache, in order; returns how many leading items were
        read (each file straight into one staging buffer: no copy per block)."""
        staging = torch.empty(len(items), self.payload_bytes, dtype=torch.uint8)
        read = 0
        for digest, key, _ in items:
            if not self._read_into(digest, key, staging[read]):
                break
            read += 1
        if not read:
            return 0
        device = self.caches[0][0].device
        ids = torch.tensor([block for _, _, block in items[:read]], dtype=torch.int64,
                           device=device)
        data = staging[:read].view(self.dtype).view(read, *self.block_shape).to(device)
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, ids, data[:, 2 * layer])
            v.index_copy_(0, ids, data[:, 2 * layer + 1])
        return read

    def _read_into(self, digest: bytes, key, out: torch.Tensor) -> bool:
        """The block's payload into `out`; False when missing, or rejected with one log line."""
        path = self._path(digest)
        payload = memoryview(out.numpy())
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_HEADER.size)
                tokens = f.read(8 * len(key.tokens))
                got = f.readinto(payload)
            os.utime(path)  # the LRU order a restart reads back
        except OSError:  # evicted meanwhile (or by another engine process sharing the folder)
            self._forget(digest)
            return False
        why = self._check(head, tokens, size, got, payload, digest, key)
        if why is not None:
            log.warning("prefix cache dir: ignored %s (%s); deleted", path, why)
            self._forget(digest)
            _unlink(path)
            return False
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
        return True

    def _check(self, head: bytes, tokens: bytes, size: int, got: int, payload: memoryview,
               digest: bytes, key) -> str | None:
        if len(head) < _HEADER.size:
            return "shorter than its header"
        magic, version, has_parent, n, length, crc, identity, stored, parent = \
            _HEADER.unpack(head)
        if magic != _MAGIC or version != _VERSION:
            return "not a block file of this version"
        if identity != self.identity:
            return "written for another model, dtype or cache shape"
        if stored != digest:
            return "its digest is not its name"
        if length != self.payload_bytes or size != _HEADER.size + 8 * n + length \
                or got != length or n != len(key.tokens):
            return "truncated or of another block size"
        if (parent if has_parent else None) != key.parent_hash \
                or struct.unpack(f"<{n}q", tokens) != key.tokens:
            return "its tokens are not the prompt's"
        if zlib.crc32(payload) != crc:
            return "checksum mismatch"
        return None

    # ---- writing (the writer thread) ---------------------------------------------------
    def save(self, items: list[tuple[bytes, object, int]]) -> None:
        if items:
            self._jobs.put(items)

    def written(self) -> list[int]:
        """Blocks whose files are written (or failed) since the last call: unpin them."""
        return [block for items in _take_all(self._written) for _, _, block in items]

    def drain(self) -> None:
        """Wait until every block handed to save() and fetch() is written or read."""
        self._jobs.join()
        self._reads.join()

    def close(self) -> None:
        atexit.unregister(self.close)
        for jobs, thread in zip((self._jobs, self._reads), self._threads):
            if thread.is_alive():
                jobs.put(None)
                thread.join(timeout=60)

    def _loop(self, jobs: queue.Queue, work) -> None:
        while True:
            items = jobs.get()
            try:
                if items is None:
                    return
                work(items)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop the engine
                self.errors += 1
                if self.errors == 1 or self.errors % 1000 == 0:
                    log.warning("prefix cache dir: %d blocks failed (%d failures so far): "
                                "%s: %s", len(items), self.errors,
                                type(exc).__name__, exc)
            finally:
                jobs.task_done()

    def _write(self, items: list[tuple[bytes, object, int]]) -> None:
        try:
            self._write_files(items)
        finally:
            self._written.put(items)

    def _write_files(self, items: list[tuple[bytes, object, int]]) -> None:
        device = self.caches[0][0].device
        ids = torch.tensor([block for _, _, block in items], dtype=torch.int64, device=device)
        data = torch.stack([t.index_select(0, ids) for kv in self.caches for t in kv], dim=1)
        data = data.cpu().contiguous().view(torch.uint8).view(len(items), -1)
        for (digest, key, _), payload in zip(items, data):
            body = memoryview(payload.numpy())
            parent = key.parent_hash
            header = _HEADER.pack(_MAGIC, _VERSION, parent is not None, len(key.tokens),
                                  len(body), zlib.crc32(body), self.identity, digest,
                                  parent or b"\0" * 32)
            path = self._path(digest)
            temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(temp, "wb") as f:
                f.write(header)
                f.write(struct.pack(f"<{len(key.tokens)}q", *key.tokens))
                f.write(body)
            os.replace(temp, path)
            size = len(header) + 8 * len(key.tokens) + len(body)
            with self._lock:
                if digest not in self._index:
                    self.total_bytes += size
                self._index[digest] = size
                self._index.move_to_end(digest)
                self._evict()


def _take_all(results: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            return out


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
