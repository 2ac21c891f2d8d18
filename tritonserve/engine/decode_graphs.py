"""Decode-only steps on static input buffers, one entry per batch-size bucket (vLLM's CUDA-graph
runner). A step of n sequences runs the smallest bucket >= n; rows n.. of the bucket are padding
that write their K/V to the null block (the cache's last block, which no request owns) and
attend to that one slot, so they never touch a request's cache.

Modes (EngineConfig.decode_mode):
- static: the model's forward on the static buffers, op by op. The CUDA-graph path minus the
  capture: what the CPU tests run to check bucketing and padding.
- compile: torch.compile (Inductor, fullgraph) of the forward, compiled at start-up, the
  attention and the matmuls through the tritonserve ops (engine/attention.py, models/linear.py).
  Nothing is captured, so nothing needs padding: two graphs, one for a single sequence and one
  whose batch size is dynamic (2..largest bucket), and every step runs at its own size. Per
  bucket (the graphs' former layout) eleven SmolLM2 buckets took ~11 s each from a warm cache
  and a step of 17 rows paid for 24. One graph with an *unbacked* batch size (batch 1 too)
  halved the warm compile (23 -> 11 s), but Inductor fused less around an unbacked size (the
  residual add apart from the RMSNorm, more OpenMP loops a layer): batch 16 steps ran 10-25 %
  slower, batch 1 10-20 % (docs/perf-log/2026-cpu-decode.md). A size's first step goes through Dynamo;
  its later steps call the compiled graph directly with the inputs Dynamo passed it (the
  same tensors every step: CUDA-graph replay's contract, without the capture), ~1 ms a step
  less at batch 1, 16 and 64 on a Zen 5 (docs/perf-log/2026-cpu-decode.md).
- cudagraph / compile+cudagraph: each bucket captured into a CUDA graph at start-up (after a
  warm-up run that compiles and autotunes the Triton kernels) and replayed every step.

Contract: `run(input_ids, positions, meta)` takes a decode-only step of at most `max_batch` rows
and returns hidden states [n, hidden] that stay valid until the next run.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from tritonserve.cache import cache_root

from .attention import AttentionBackend, AttentionMetadata
from .config import DECODE_MODES
from .models import ForwardContext

log = logging.getLogger("tritonserve.engine")

MODES = tuple(m for m in DECODE_MODES if m not in ("auto", "eager", "layers"))


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's sizes)."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8))
    return sorted(sizes | {max_num_seqs})


def use_compile_cache() -> None:
    """Inductor's and Triton's caches under ~/.cache/tritonserve, unless the user chose others:
    a second start loads the compiled code instead of generating it (measured on the tiny
    test model: 48 s to build five buckets cold, 8.5 s warm)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    root = cache_root()
    # Inductor writes its default into the environment the first time anything asks for it
    # (transformers can, while saving a model), so "unset" includes "set to the default"
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, null_block: int, block_size: int,
                 sizes: list[int], max_model_len: int, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"decode_mode must be one of {MODES}, got {mode!r}")
        device = kv_caches[0][0].device  # EngineConfig checked that cudagraph modes have CUDA
        self.mode = mode
        self.dynamic = mode == "compile"
        self.sizes = sorted(set(sizes))
        if self.dynamic:  # a graph for 1 (dynamo specialises size 1 anyway), one for the rest
            self.sizes = sorted({1, self.sizes[-1]})
        self.max_batch = self.sizes[-1]
        self.null_block = null_block
        self.null_slot = null_block * block_size
        width = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(self.max_batch, dtype=i64, device=device)  # [B]
        self.positions = torch.zeros(self.max_batch, dtype=i64, device=device)  # [B]
        self.slot_mapping = torch.full((self.max_batch,), self.null_slot, dtype=i64,
                                       device=device)  # [B]
        self.block_tables = torch.full((self.max_batch, width), null_block, dtype=i32,
                                       device=device)  # [B, max blocks a sequence]
        self.seq_lens = torch.ones(self.max_batch, dtype=i32, device=device)  # [B]
        self.empty = torch.zeros(0, dtype=i32, device=device)
        self.max_model_len = max_model_len
        self.kv_caches, self.backend = kv_caches, backend
        self.forward: Callable = model
        if mode.startswith("compile"):
            use_compile_cache()
            if self.dynamic:  # the cache size symbolic: another engine of this model in the
                # process (the graphs live on the forward's code object) reuses the graphs
                for cache in kv_caches:
                    for t in cache:
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            _allow_recompiles(len(self.sizes))
            # No `freezing`: with it Inductor's GEMMs still ran as aten::mm / addmm on the test
            # CPU, and it bypasses the FX graph cache (a warm start of three SmolLM2 buckets
            # took 72 s with it; docs/perf-log/2026-cpu-decode.md)
            # dynamic=None: the dims marked below are symbolic, all else static
            # No size asserts: Inductor's generated code checked the size and strides of
            # every input and of every custom op's output on each call, from Python: 399
            # checks a SmolLM2 step at 0.36 us each, ~0.15 ms (2 % of a batch-1 step on a
            # Zen 5; docs/perf-log/2026-cpu-decode.md). The inputs are the static buffers,
            # the caches and the weights this object was built with; the ops' fake
            # implementations are checked against the ops by opcheck in the tests.
            self.forward = torch.compile(model, fullgraph=True,
                                         dynamic=None if self.dynamic else False,
                                         backend=_inductor_recording)
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        # size -> the compiled graph called with the inputs Dynamo passed it (see run);
        # direct_calls False sends every step through Dynamo (bench profile --ab-direct)
        self.direct: dict[int, Callable[[], torch.Tensor]] = {}
        self.direct_calls = mode == "compile"
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            run = self._make_run(size)
            with torch.inference_mode():
                try:
                    run()  # compiles (Inductor, Triton, autotuning) outside any capture
                except Exception as e:
                    raise RuntimeError(f"decode_mode {mode!r} could not build its batch-{size} "
                                       f"graph ({type(e).__name__}); --enforce-eager runs the "
                                       f"step op by op") from e
                if "cudagraph" in mode:
                    run, pool = _capture(run, device, pool)
            self.runs[size] = run
        _last_call.entry = None  # the build's calls: run() takes its own first call's
        self.build_seconds = time.perf_counter() - start
        log.info("decode %s: %d graphs (batch 1..%d) built in %.1f s", mode, len(self.sizes),
                 self.max_batch, self.build_seconds)

    def _make_run(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward over the first `size` rows of the static buffers. num_decode_tokens is
        None ("every row") in the dynamic graph, so the row count stays symbolic; max_seq_len
        is max_model_len: fixed, so the Triton decode's split count (a launch parameter) is
        the same at every replay; empty splits exit at once."""
        ids, pos, slots, tables, lens = (
            self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
            self.block_tables[:size], self.seq_lens[:size])
        if self.dynamic and size > 1:  # the batch dim symbolic (dynamo specialises 1)
            for t in (ids, pos, slots, tables, lens):
                torch._dynamo.mark_dynamic(t, 0)
        if self.dynamic:  # the table width too (another max_model_len reuses the graphs)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
        empty = self.empty
        meta = AttentionMetadata(slots, None if self.dynamic else size, tables, lens,
                                 self.max_model_len, empty.view(0, 0), empty,
                                 torch.zeros(1, dtype=empty.dtype, device=empty.device), 0)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        forward = self.forward
        return lambda: forward(ids, pos, ctx)

    def bucket(self, n: int) -> int:
        """The rows a step of n runs: n itself in the dynamic graph, else the next bucket."""
        return n if self.dynamic else next(s for s in self.sizes if s >= n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step of n <= max_batch rows -> hidden [n, hidden]."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        if size > n:  # padding rows: one token in the null block
            self.slot_mapping[n:size].fill_(self.null_slot)
            self.block_tables[n:size, 0].fill_(self.null_block)
            self.seq_lens[n:size].fill_(1)
        direct = self.direct.get(size) if self.direct_calls else None
        if direct is not None:
            return direct()[:n]
        run = self.runs.get(size)
        fresh = run is None
        if fresh:  # the dynamic graph at a new size: a new closure
            run = self.runs[size] = self._make_run(size)
        _last_call.entry = None
        if fresh:
            # Its first call checks every guard: the graphs on the forward's code object are
            # shared by every engine of the model in the process, and the reduced set below
            # raised "Recompilation triggered with skip_guard_eval_unsafe stance" at a size
            # no step had run yet (speculative rows, tests/test_speculative.py, after other
            # engines in the test process); a full check finds the graph or compiles one.
            out = run()
        else:
            # Dynamo's guards on every call checked ~400 tensors (the weights are graph
            # inputs, so that engines of one model share graphs): 0.9 ms a step, 10 % of a
            # batch-1 SmolLM2 step on a Zen 5. This size's graph has run once with all its
            # guards, so only those that tell the cached graphs apart need to run: 0.15 ms.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = run()
        entry, _last_call.entry = _last_call.entry, None  # held here only: it holds the inputs
        if self.direct_calls and entry is not None:
            # Dynamo's graph returns a tuple that its bytecode unpacks: the direct call keeps
            # the element that is the forward's own return value, when one is
            call, outputs = entry
            index = next((i for i, t in enumerate(outputs) if t is out), None)
            if index is not None:
                self.direct[size] = lambda: call()[index]
        return out[:n]


class _LastCall(threading.local):
    entry: tuple[Callable[[], tuple], tuple] | None = None  # (call again, its outputs)


_last_call = _LastCall()


def _inductor_recording(gm: torch.fx.GraphModule, example_inputs):
    """Inductor (without its size asserts, see __init__), whose compiled graph notes each call
    and its inputs in _last_call. A bucket's closure passes the same tensors every step (the
    static buffers, the caches, the weights; its sizes are fixed), so after its first step
    DecodeGraphs.run calls the graph with them directly: no Dynamo frame, no guards and no
    pregraph bytecode gathering ~310 inputs (profiled 0.25 + 0.2 ms; 0.4-1.5 ms a step in
    alternated runs at batch 1, 16 and 64 on a Zen 5;
    docs/perf-log/2026-cpu-decode.md). One function for every engine:
    Dynamo reuses a graph only for the backend that compiled it."""
    from torch._inductor.compile_fx import compile_fx
    compiled = compile_fx(gm, example_inputs, config_patches={"size_asserts": False})

    def call(*args):  # Dynamo calls its backend's graph with the inputs unpacked
        outputs = compiled(*args)
        _last_call.entry = (lambda: compiled(*args), outputs)
        return outputs

    return call


def _allow_recompiles(count: int) -> None:
    """One graph per bucket, and the graphs of every engine in this process share the model
    forward's code object: dynamo's recompile limit (8 per code object; fullgraph makes passing
    it an error) would stop the third engine of another model shape in one process (the tests
    build many)."""
    import torch._dynamo.config as dynamo
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), 64, count + 1))


def _capture(run: Callable[[], torch.Tensor], device: torch.device, pool):
    """Capture `run` into a CUDA graph on a side stream (torch.cuda.graph's own); returns the
    replay callable, whose output tensor the graph rewrites in place, and the memory pool."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    torch.cuda.synchronize(device)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, graph.pool()
