"""The prefix cache's disk tier (engine/disk_cache.py, --prefix-cache-dir): blocks written
behind the engine, served after a restart exactly as a memory hit would be, bounded by LRU,
and a corrupt, truncated or foreign file ignored with one log line, never served."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tritonserve.engine.disk_cache import _HEADER
from tritonserve.engine.llm import LLM, build_config
from tritonserve.engine.sampling_params import SamplingParams

PROMPT = [5 + (7 * i) % 300 for i in range(150)]  # 9 full blocks of 16, the last one partial
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)


def _engine(model: str, folder, **options) -> LLM:
    return LLM(model, prefix_cache_dir=str(folder), num_blocks=64, **options)


def _files(folder) -> list[Path]:
    return sorted(Path(folder).rglob("*.kv"))


def _run(llm: LLM, prompt=PROMPT):
    out = llm.generate(prompt, GREEDY)[0]
    return out.token_ids, [(t.logprob, t.top_logprobs) for t in out.logprobs]


@pytest.fixture(scope="module")
def written(tiny_model, tmp_path_factory):
    """A folder the first engine filled, and what its second run of PROMPT (a memory hit of
    the same 9 blocks) gave: a read from disk must give exactly that."""
    folder = tmp_path_factory.mktemp("prefix-disk")
    llm = _engine(tiny_model, folder)
    _run(llm)
    memory_hit = _run(llm)
    assert llm.engine.kv_cache.stats.hit_tokens == 144
    llm.engine.close()  # waits for the writer
    return folder, memory_hit


def _copy(src: Path, dst: Path) -> Path:
    for path in src.rglob("*.kv"):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return dst


def test_a_restart_reads_the_prefix_back_exactly(tiny_model, written, tmp_path):
    folder, memory_hit = written
    assert len(_files(folder)) == 9  # the 9 full blocks, prompt and output alike
    llm = _engine(tiny_model, _copy(folder, tmp_path))
    assert _run(llm) == memory_hit  # same tokens, same logprobs to the bit
    stats = llm.engine.kv_cache.stats
    assert stats.hit_tokens == 144 and stats.disk_read_tokens == 144
    llm.engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_file_is_ignored_with_one_line_and_deleted(tiny_model, written, tmp_path,
                                                            caplog, damage):
    folder, memory_hit = written
    _copy(folder, tmp_path)
    # the 5th block of the prompt's chain: the read stops before it, the rest is computed
    from tritonserve.engine.kv_cache import prompt_digests
    victim = next(p for p in _files(tmp_path)
                  if p.name.startswith(prompt_digests(PROMPT, 16)[4].hex()))
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x40
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    else:  # written by another model / dtype: the identity field differs
        raw[_HEADER.size - 96] ^= 0xFF
    victim.write_bytes(bytes(raw))
    llm = _engine(tiny_model, tmp_path)
    with caplog.at_level("WARNING", logger="tritonserve.engine"):
        assert _run(llm)[0] == memory_hit[0]
    lines = [r for r in caplog.records if "prefix cache dir: ignored" in r.getMessage()]
    assert len(lines) == 1 and victim.name in lines[0].getMessage()
    assert llm.engine.kv_cache.stats.disk_read_tokens == 4 * 16  # the blocks before it
    llm.engine.close()
    assert victim.exists()  # deleted, then written again from the recomputed block
    assert victim.read_bytes() != bytes(raw)


def test_the_folder_is_bounded_least_recently_used_first(tiny_model, tmp_path):
    llm = _engine(tiny_model, tmp_path)
    disk = llm.engine.kv_cache.disk
    disk.max_bytes = 12 * (disk.payload_bytes + _HEADER.size + 16 * 8)  # room for 12 blocks
    first, second = PROMPT, [7 + (11 * i) % 300 for i in range(150)]
    _run(llm, first)
    llm.engine.kv_cache.settle_disk(drain=True)
    _run(llm, second)
    llm.engine.close()
    names = {p.name[:64] for p in _files(tmp_path)}
    from tritonserve.engine.kv_cache import prompt_digests
    assert len(names) == 12 and disk.total_bytes <= disk.max_bytes
    assert {d.hex() for d in prompt_digests(second, 16)} <= names  # the newest kept
    # after a restart the index holds what is on disk, and the bound holds again
    llm = _engine(tiny_model, tmp_path, prefix_cache_disk_gb=disk.max_bytes / 2**30 / 2)
    assert len(llm.engine.kv_cache.disk) == 6 == len(_files(tmp_path))
    llm.engine.close()


def test_the_engine_steps_on_while_the_writer_is_stuck(tiny_model, tmp_path):
    llm = _engine(tiny_model, tmp_path)
    disk = llm.engine.kv_cache.disk
    gate = threading.Event()
    write = disk._write_files
    disk._write_files = lambda items: (gate.wait(60), write(items))
    tokens, _ = _run(llm)  # finishes although no block could be written yet
    assert len(tokens) == 8 and _files(tmp_path) == []
    assert llm.engine.kv_cache.num_used_blocks == 9  # pinned for the writer, not leaked
    gate.set()
    llm.engine.kv_cache.settle_disk(drain=True)
    assert llm.engine.kv_cache.num_used_blocks == 0 and len(_files(tmp_path)) == 9
    assert llm.engine.reset_prefix_cache()
    llm.engine.close()


def test_others_are_served_while_a_prefix_is_read(tiny_model, written, tmp_path):
    folder, memory_hit = written
    llm = _engine(tiny_model, _copy(folder, tmp_path))
    engine, disk = llm.engine, llm.engine.kv_cache.disk
    gate = threading.Event()
    load = disk.load
    disk.load = lambda items: (gate.wait(60), load(items))[1]
    slow = engine.add_request(PROMPT, GREEDY)  # first in the queue, its read held back
    other = engine.add_request([9, 8, 7] * 10, SamplingParams(max_tokens=8, temperature=0,
                                                              ignore_eos=True))
    tokens = {slow: [], other: []}
    for _ in range(100):
        for step in engine.step():
            tokens[step.request_id] += [step.token.token_id] if step.token else []
        if len(tokens[other]) == 8:
            break
    assert len(tokens[other]) == 8 and tokens[slow] == [] and engine.kv_cache.reading
    gate.set()
    while engine.has_unfinished_requests():
        for step in engine.step():
            tokens[step.request_id] += [step.token.token_id] if step.token else []
    assert tokens[slow] == memory_hit[0]
    assert engine.kv_cache.stats.disk_read_tokens == 144
    engine.close()


def test_a_request_that_may_not_hit_reads_nothing(tiny_model, written, tmp_path):
    folder, _ = written
    llm = _engine(tiny_model, _copy(folder, tmp_path))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert len(out[0].prompt_logprobs) == len(PROMPT)
    assert llm.engine.kv_cache.stats.disk_read_tokens == 0
    llm.engine.close()


def test_bad_options_name_themselves(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="needs prefix caching"):
        build_config(tiny_model, prefix_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache_disk_gb"):
        build_config(tiny_model, prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        build_config(tiny_model, prefix_cache_dir=str(tmp_path), tensor_parallel_size=2)
    from tritonserve.server.__main__ import engine_config, parse_args
    config = engine_config(parse_args(["--model", tiny_model, "--prefix-cache-dir",
                                       str(tmp_path), "--prefix-cache-disk-gb", "2.5"]))
    assert (config.cache.prefix_cache_dir, config.cache.prefix_cache_disk_gb) == \
        (str(tmp_path), 2.5)
