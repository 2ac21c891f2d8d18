"""Property-based tests of the KV-cache manager, driven through the scheduler with a fake
model step: whatever the order of adds, steps, finishes and aborts, no block is owned twice,
owned + free = total, and every block comes back."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tritonserve.engine.config import SchedulerConfig
from tritonserve.engine.kv_cache import KVCacheManager
from tritonserve.engine.request import Request, RequestStatus
from tritonserve.engine.sampling_params import SamplingParams
from tritonserve.engine.scheduler import Scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def make_request(i: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id=f"r{i}", prompt=None, prompt_token_ids=prompt,
                   params=SamplingParams(max_tokens=max_tokens), arrival_time=float(i),
                   eos_token_ids=frozenset(), detokenizer=None, stop_matcher=None)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10),
                                   self.kv)
        self.live: dict[str, Request] = {}
        self.count = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
          max_tokens=st.integers(1, 8))
    def add(self, prefix, tail, max_tokens):
        prompt = prefix + tail
        if self.kv.blocks_needed(len(prompt) + max_tokens) > NUM_BLOCKS:
            return  # the engine rejects these before they reach the scheduler
        request = make_request(self.count, prompt, max_tokens)
        self.count += 1
        self.live[request.request_id] = request
        self.scheduler.add(request)

    @precondition(lambda self: self.live)
    @rule(token=st.integers(0, 3))
    def step(self, token):
        """What LLMEngine.step does, with a fake model that samples `token`."""
        out = self.scheduler.schedule()
        for s in out.scheduled:
            request = s.request
            assert request.num_computed_tokens == s.start
            assert len(request.block_ids) * BLOCK_SIZE >= s.start + s.num_new_tokens
            request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(request)
            if s.samples:
                request.token_ids.append(token)
                if request.num_output_tokens >= request.params.max_tokens:
                    self.scheduler.remove(request)
                    del self.live[request.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.scheduler.remove(self.live.pop(request_id))

    @invariant()
    def no_block_owned_twice_and_counts_add_up(self):
        owners = Counter()
        for request in self.live.values():
            assert len(set(request.block_ids)) == len(request.block_ids), "a block twice"
            owners.update(request.block_ids)
            if request.status is RequestStatus.WAITING:
                assert not request.block_ids, "a waiting request holds blocks"
        for block in range(NUM_BLOCKS):
            assert self.kv.ref_count(block) == owners[block], f"block {block} ref count"
        assert len(owners) + self.kv.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for request in list(self.live.values()):
            self.scheduler.remove(request)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(self.kv.ref_count(b) == 0 for b in range(NUM_BLOCKS))


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_prefix_hit_is_confirmed_and_never_covers_the_last_token():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    first = make_request(0, list(range(12)), 2)
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    same = make_request(1, list(range(12)), 2)
    hits = kv.find_cached_prefix(same)
    assert hits == first.block_ids[:2], "the block holding the last token must be recomputed"
    other = make_request(2, list(range(8)) + [99, 99, 99, 99, 5], 2)
    assert kv.find_cached_prefix(other) == first.block_ids[:2]
    kv.free(first)
    assert kv.find_cached_prefix(same) == hits  # freed, but still cached
    # allocating every free block evicts the cached ones (least recently freed first)
    hog = make_request(3, [7] * 64, 1)
    assert kv.allocate(hog, 64)
    assert kv.find_cached_prefix(same) == []


def test_prefix_keys_are_sha256_chains_and_a_hit_compares_content(monkeypatch):
    from tritonserve.engine.kv_cache import BlockKey
    key = BlockKey(None, (1, 2, 3, 4))
    assert len(key.digest) == 32 and key.digest != BlockKey(key.digest, (1, 2, 3, 4)).digest
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    first = make_request(0, list(range(12)), 2)
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    # force every digest to collide: a crafted prompt must still not splice first's KV in
    monkeypatch.setattr(BlockKey, "digest", property(lambda self: b"\x00" * 32))
    other = make_request(1, [50 + t for t in range(12)], 2)
    assert kv.find_cached_prefix(other) == []


class FakeDisk:
    """The disk tier's contract (engine/disk_cache.py) over a dict, with the writer's delay
    made explicit: a block is copied out only when the `write` rule runs."""

    blocks_per_read = 3

    def __init__(self, content: dict[int, tuple]) -> None:
        self.content = content  # block -> the tokens its K/V was computed for
        self.files: dict[bytes, tuple] = {}  # digest -> (key, content)
        self.jobs: list[list] = []
        self.done: list[int] = []
        self.reads: list[list] = []
        self.read_done: list[tuple[list, int]] = []

    def has(self, digest):
        return digest in self.files

    def save(self, items):
        self.jobs.append(items)

    def write_one(self):
        for digest, key, block in self.jobs.pop(0):
            self.files[digest] = (key, self.content[block])
            self.done.append(block)

    def written(self):
        done, self.done = self.done, []
        return done

    def drain(self):
        while self.jobs:
            self.write_one()
        while self.reads:
            self.read_one()

    def fetch(self, items):
        self.reads.append(items)

    def fetched(self, wait_s=0.0):
        done, self.read_done = self.read_done, []
        return done

    def read_one(self):
        items = self.reads.pop(0)
        read = 0
        for digest, key, block in items:
            stored = self.files.get(digest)
            if stored is None or stored[0] != key:
                break
            self.content[block] = stored[1]
            read += 1
        self.read_done.append((items, read))

    def pinned(self) -> Counter:
        pins = Counter(block for job in self.jobs + self.reads for _, _, block in job)
        pins.update(self.done)
        pins.update(block for items, _ in self.read_done for _, _, block in items)
        return pins


class DiskCacheMachine(CacheMachine):
    """CacheMachine with a disk tier, whose writer lags and which outlives the manager: a
    block pinned for the writer is never handed out, a block read back holds what its key
    says, and ref counts are owners plus pins."""

    def __init__(self) -> None:
        super().__init__()
        self.content: dict[int, tuple] = {}
        self.disk = FakeDisk(self.content)
        self._restart()

    def _restart(self):
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True,
                                 disk=self.disk)
        self.kv.max_disk_pins = 6
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10),
                                   self.kv)

    @precondition(lambda self: self.live)
    @rule(token=st.integers(0, 3))
    def step(self, token):
        self.kv.settle_disk()
        out = self.scheduler.schedule()
        for s in out.scheduled:
            request = s.request
            end = s.start + s.num_new_tokens
            for i in range(s.start // BLOCK_SIZE, -(-end // BLOCK_SIZE)):
                self.content[request.block_ids[i]] = tuple(
                    request.token_ids[i * BLOCK_SIZE:min(end, (i + 1) * BLOCK_SIZE)])
        super_step_rest(self, out, token)
        self.kv.write_behind()

    @precondition(lambda self: self.disk.jobs)
    @rule()
    def write(self):
        self.disk.write_one()

    @precondition(lambda self: self.disk.reads)
    @rule()
    def read(self):
        self.disk.read_one()

    @precondition(lambda self: not self.live)
    @rule()
    def restart(self):
        """The process ends (its writes finished) and a new one starts on the same folder."""
        self.kv.settle_disk(drain=True)
        self.content.clear()
        self._restart()

    @invariant()
    def a_cached_block_holds_its_key(self):
        for block, key in enumerate(self.kv._block_key):
            if key is not None:
                assert self.content.get(block) == key.tokens, f"block {block} holds stale K/V"

    @invariant()
    def no_block_owned_twice_and_counts_add_up(self):
        owners = Counter()
        for request in self.live.values():
            assert len(set(request.block_ids)) == len(request.block_ids), "a block twice"
            owners.update(request.block_ids)
        pins = self.disk.pinned()
        for block in range(NUM_BLOCKS):
            assert self.kv.ref_count(block) == owners[block] + pins[block], f"block {block}"
        assert len(owners | pins) + self.kv.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for request in list(self.live.values()):
            self.scheduler.remove(request)
        self.kv.settle_disk(drain=True)
        assert self.kv.num_free_blocks == NUM_BLOCKS


def super_step_rest(machine: CacheMachine, out, token) -> None:
    """CacheMachine.step after schedule(): advance, register full blocks, sample, finish."""
    for s in out.scheduled:
        request = s.request
        assert request.num_computed_tokens == s.start
        request.num_computed_tokens += s.num_new_tokens
        machine.kv.cache_full_blocks(request)
        if s.samples:
            request.token_ids.append(token)
            if request.num_output_tokens >= request.params.max_tokens:
                machine.scheduler.remove(request)
                del machine.live[request.request_id]


TestDiskCacheMachine = DiskCacheMachine.TestCase
TestDiskCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
