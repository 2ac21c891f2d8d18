"""Turns a SchedulerOutput into one forward pass over a flattened token batch, and samples."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from tritonserve.kernels import cpu

from .attention import AttentionMetadata, make_attention_backend
from .config import EngineConfig
from .decode_graphs import DecodeGraphs, bucket_sizes
from .memory import DeviceMemory
from .models import ForwardContext, ModelArch, build_model
from .models.compressed import read_compressed, scheme_of
from .models.gguf import dense_experts, experts_served
from .parallel import Shard
from .plan import resolve_plan
from .lora import LoraBatch, batch_of
from .pooling import PoolRows, pool, pool_rows
from .prompt_logprobs import PromptRows, rows_of, score
from .request import Request
from .sampler import SampledToken, Sampler
from .scheduler import ScheduledRequest, SchedulerOutput
from .speculative import verify
from .weights import put_in_form


def _phase(name: str):
    """A profiler range named for `bench profile`'s phase table, only while a profiler
    records (record_function costs ~7 us a range when none does: four a step)."""
    return record_function(name) if _profiler_enabled() else nullcontext()


log = logging.getLogger("tritonserve.engine")


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the hidden states whose logits are sampled
    sample_requests: list[Request]  # [S]; a speculating request's K + 1 rows are not here
    # speculating requests: (request, proposals, the first of its K + 1 rows in
    # sample_indices after the S sampled ones)
    spec: tuple[tuple[Request, tuple[int, ...], int], ...] = ()
    # rows whose logits score prompt tokens (SamplingParams.prompt_logprobs)
    prompt_rows: tuple[PromptRows, ...] = ()
    pool_rows: tuple[PoolRows, ...] = ()  # rows an embedding request pools
    lora: LoraBatch | None = None  # the rows of each adapter (engine/lora.py)


class ModelRunner:
    """Built in two stages, so that the cache can be sized from what is left once the weights
    are loaded (CUDA): __init__ loads the model; allocate() makes the KV cache and sampler."""

    def __init__(self, config: EngineConfig, arch: ModelArch, folder: Path | None,
                 max_positions: int, gguf: Path | None = None, shard: Shard = Shard()) -> None:
        """max_positions: the longest max_model_len this engine may resolve (RoPE table);
        gguf: the GGUF file the folder was converted from (its blocks serve where the plan's
        weights say gguf); shard: a tensor-parallel rank's place (arch is then the rank's
        share, parallel.local_arch; engine/tp_runner.py runs the ranks)."""
        self.config = config
        self.arch = arch
        self.device = torch.device(config.device)
        self.memory = DeviceMemory(self.device)
        scheme = scheme_of(folder)
        self.plan = resolve_plan(config, arch, gguf, scheme)
        log.info("decode plan: %s", self.plan.describe())
        self.block_size = config.cache.block_size
        dense, packed = (read_compressed(folder, scheme) if scheme is not None
                         and config.load_format != "dummy" else (None, None))
        # a mixture's experts as a GGUF file's blocks: never loaded dense (engine/models/gguf.py);
        # the converted folder has none of them, so a dense load reads them from the file
        blocks = gguf is not None and arch.variant.experts is not None and experts_served(gguf)
        experts_later = blocks and self.plan.weights == "gguf" and shard.size == 1
        if blocks and not experts_later and config.load_format != "dummy":
            dense = {**(dense or {}), **dense_experts(gguf, arch.family)}
        self.model = build_model(arch, folder, config.torch_dtype, self.device, max_positions,
                                 dummy=config.load_format == "dummy", seed=config.seed,
                                 substitute=dense, shard=shard, experts_later=experts_later)
        del dense
        if shard.size > 1:
            self.model.reduce_row_parallel(shard.all_reduce)
        self.weights = put_in_form(self.model, self.plan.weights, self.plan.dense_above,
                                   config, arch, gguf, folder, packed, scheme)
        del packed
        # the dense twin's projections take LoRA rows (else an adapter's step runs the form's)
        self.twin_takes_lora = self.weights.dense is None or _takes_lora(self.weights.dense)
        self.backend = make_attention_backend(self.plan.attention)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        # a decode-only step of at most decode_max_batch rows runs decode_step (allocate)
        self.decode_step = None
        self.dense_decode_step = None  # decode_step on the dense panels (plan.dense_above)
        self.decode_max_batch = 0
        # whether decode_step / dense_decode_step take LoRA rows: the layers op does where no
        # gate/up applies silu in its matmul (kernels/cpu/lora_rows.h)
        self.decode_takes_lora = self.dense_takes_lora = False

    @property
    def decode_mode(self) -> str:
        return self.plan.mode

    def kernels_in_use(self) -> str:
        """One phrase for the start-up line: which kernels this runner's steps call."""
        if self.plan.attention == "triton":
            return "Triton kernels"
        if self.plan.attention == "cpu":
            return f"C++ CPU ops, {cpu.describe()}"
        return "torch kernels"

    @torch.inference_mode()
    def profile_peak_bytes(self, max_model_len: int) -> int:
        """Device memory one largest step takes beyond the weights (CUDA): a forward over
        max_num_batched_tokens prompt tokens (sequences of up to max_model_len) against a
        one-block cache, then the logits of max_num_seqs rows. vLLM sizes its cache the same
        way. Every slot is -1 (nothing written) and every block table row reads block 0."""
        sched = self.config.scheduler
        tokens = max(1, sched.max_num_batched_tokens)
        lengths = [min(max_model_len, tokens - start) for start in range(0, tokens, max_model_len)]
        kv_dtype = self.config.kv_dtype
        shape = (1, self.block_size, self.arch.num_kv_heads, self.arch.kv_row(kv_dtype))
        caches = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                   torch.zeros(shape, dtype=kv_dtype, device=self.device))
                  for _ in range(self.arch.num_layers)]
        width = -(-max(lengths) // self.block_size)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=self.device),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
            decode_max_seq_len=0,
            prefill_block_tables=torch.zeros(len(lengths), width, dtype=torch.int32,
                                             device=self.device),
            prefill_seq_lens=self._tensor(lengths, torch.int32),
            prefill_cu_seqlens_q=self._tensor(cu, torch.int32),
            prefill_max_q_len=max(lengths))
        positions = self._tensor([p for n in lengths for p in range(n)], torch.int64)
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        base = self.memory.start_peak()
        hidden = self.model(input_ids, positions, ForwardContext(meta, caches, self.backend))
        rows = hidden[:1].expand(min(sched.max_num_seqs, tokens), -1)
        logits = self.model.compute_logits(rows)  # [S, V]
        torch.softmax(logits.float(), dim=-1)  # the sampler's working copy
        del hidden, logits, caches
        return self.memory.peak_since(base)

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """The KV cache (num_blocks for requests, from engine/memory.py, plus the null block
        that padding rows of a bucketed decode step write to), the sampler, and the decode
        graphs of the decode mode."""
        config, arch = self.config, self.arch
        self.num_blocks = num_blocks
        self.memory.check_cache_fits(self.num_blocks, config, arch)
        kv_dtype = config.kv_dtype
        shape = (self.num_blocks + 1, self.block_size, arch.num_kv_heads, arch.kv_row(kv_dtype))
        allocate = self.memory.allocate_cache
        try:
            self.kv_caches = [(allocate(shape, kv_dtype), allocate(shape, kv_dtype))
                              for _ in range(arch.num_layers)]
        except torch.OutOfMemoryError:
            self.kv_caches = []
            need = self.num_blocks * self.block_size * arch.kv_bytes_per_token(kv_dtype)
            raise ValueError(f"the KV cache ({need / 2**30:.2f} GiB, {self.num_blocks} blocks) "
                             f"does not fit in {self.device} memory next to the weights; lower "
                             f"cache_bytes / num_blocks") from None
        self.sampler = Sampler(self.plan.draw, arch.vocab_size, config.seed,
                               max_model_len, self.device)
        if self.plan.mode == "layers":
            self.decode_step = self.model.decode_layers(self.block_size)
            self.decode_max_batch = config.scheduler.max_num_seqs
            self.decode_takes_lora = _takes_lora(self.model)
            if self.weights.dense is not None:
                self.dense_decode_step = self.weights.dense.decode_layers(self.block_size)
                self.dense_takes_lora = self.twin_takes_lora
        elif self.plan.mode != "eager":
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend,
                                       null_block=self.num_blocks, block_size=self.block_size,
                                       sizes=list(config.decode_buckets) or bucket_sizes(
                                           config.scheduler.max_num_seqs),
                                       max_model_len=max_model_len, mode=self.plan.mode)
            self.decode_step = lambda ids, positions, ctx: self.graphs.run(ids, positions,
                                                                           ctx.meta)
            self.decode_max_batch = self.graphs.max_batch

    def release(self, request_id: str) -> None:
        """The request has ended: drop what the runner keeps for it (sampling rows)."""
        self.sampler.release(request_id)

    @staticmethod
    def is_device_fatal(exc: BaseException) -> bool:
        """A fault after which the device cannot be trusted (a CUDA error or device-side
        assert poisons the context): the engine must die and be restarted."""
        accelerator_error = getattr(torch, "AcceleratorError", ())
        text = str(exc)
        return (isinstance(exc, accelerator_error) or "CUDA error" in text
                or "device-side assert" in text)

    def check_health(self) -> None:
        """Raises when the runner cannot step any more (a tensor-parallel worker gone); one
        process has nothing to check."""

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput) -> dict[str, list[SampledToken]]:
        # the ranges name the phases in `bench profile`'s table (_phase)
        with _phase("prepare"):
            model_input = self.prepare(schedule.scheduled)
        return self.run(model_input)

    @torch.inference_mode()
    def forward_only(self, model_input: ModelInput) -> None:
        """A tensor-parallel worker's step: the forward (its all-reduces meet rank 0's), no
        logits, no sampling."""
        self._forward(model_input, ForwardContext(model_input.meta, self.kv_caches,
                                                  self.backend))

    @torch.inference_mode()
    def run(self, model_input: ModelInput) -> dict[str, list[SampledToken]]:
        """The forward, the sampled rows' logits and the draw of a prepared step: one token a
        request, or a speculating request's accepted proposals and one more."""
        masks = self.sampler.start_masks(model_input.sample_requests)  # overlaps the forward
        return self.sample(model_input, self.forward(model_input), masks)

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        """run's forward: under tensor parallelism the part where the ranks meet."""
        ctx = ForwardContext(model_input.meta, self.kv_caches, self.backend, model_input.lora)
        with _phase("forward"):
            return self._forward(model_input, ctx)

    def sample(self, model_input: ModelInput, hidden: torch.Tensor,
               masks=None) -> dict[str, list[SampledToken]]:
        """run's logits and draw, after the forward: this rank's alone. Prompt logprobs are
        appended to their requests (engine/prompt_logprobs.py)."""
        if model_input.pool_rows:
            pool(hidden, model_input.pool_rows)
        if model_input.prompt_rows:
            with _phase("logits"):
                score(hidden, model_input.prompt_rows,
                      lambda rows: self.weights.model_for(rows.shape[0]).compute_logits(rows))
        if not model_input.sample_requests and not model_input.spec:
            return {}
        with _phase("logits"):
            rows = hidden[model_input.sample_indices]
            logits = self.weights.model_for(rows.shape[0]).compute_logits(rows)  # [S, V]
        out: dict[str, list[SampledToken]] = {}
        with _phase("sampler"):
            count = len(model_input.sample_requests)
            if count:
                sampled = self.sampler(logits[:count], model_input.sample_requests, masks)
                out = {r.request_id: [s] for r, s in zip(model_input.sample_requests, sampled)}
            for request, proposals, first in model_input.spec:
                out[request.request_id] = verify(logits[first:first + len(proposals) + 1],
                                                 list(proposals), request)
        return out

    def _forward(self, model_input: ModelInput, ctx: ForwardContext) -> torch.Tensor:
        """hidden [T, hidden]: the plan's decode step for a decode-only step it takes, else
        the model op by op."""
        n = model_input.input_ids.shape[0]
        model = self.weights.model_for(n)
        if model_input.lora is not None and model is not self.model and not self.twin_takes_lora:
            model = self.model  # the dense twin's gate/up applies silu: no adapter there
        step, takes_lora = (self.decode_step, self.decode_takes_lora) if model is self.model \
            else (self.dense_decode_step, self.dense_takes_lora)
        if step is not None and model_input.meta.num_decode_tokens == n <= self.decode_max_batch \
                and (model_input.lora is None or takes_lora):
            return step(model_input.input_ids, model_input.positions, ctx)
        return model(model_input.input_ids, model_input.positions, ctx)

    def prepare(self, scheduled: list[ScheduledRequest]) -> ModelInput:
        """Decode rows first, then prefill chunks. A speculating request is K + 1 decode rows
        (its last token, then each proposal) over the same block table, row j at position
        start + j attending to start + j + 1 positions: every row's K/V is written before
        any row attends (store first in each attention path; the layers op's write_first)."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1 or s.proposals]
        prefills = [s for s in scheduled if s.num_new_tokens != 1 and not s.proposals]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        sample_requests: list[Request] = []
        spec_rows: list[int] = []
        spec: list[tuple[Request, tuple[int, ...], int]] = []
        prompt_rows: list[PromptRows] = []
        pooled: list[PoolRows] = []
        decode_rows: list[ScheduledRequest] = []  # one per decode row (a table and a length)
        decode_lens: list[int] = []
        for i, s in enumerate(decodes + prefills):
            r = s.request
            end = s.start + s.num_new_tokens
            ids = r.token_ids[s.start:end - len(s.proposals)] + list(s.proposals)
            if s.start < r.num_prompt_tokens and not s.proposals:  # a prompt chunk
                if rows := rows_of(r, s.start, end, len(input_ids)):
                    prompt_rows.append(rows)
                if rows := pool_rows(r, s.start, end, len(input_ids)):
                    pooled.append(rows)
            input_ids.extend(ids)
            positions.extend(range(s.start, end))
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(s.start, end))
            if s.proposals:
                spec.append((r, s.proposals, len(spec_rows)))
                spec_rows.extend(range(len(input_ids) - len(ids), len(input_ids)))
            elif s.samples and r.params.max_tokens > 0:  # 0: scored or embedded, no draw
                sample_indices.append(len(input_ids) - 1)
                sample_requests.append(r)
            if i < len(decodes):
                decode_rows.extend([s] * s.num_new_tokens)
                decode_lens.extend(range(s.start + 1, end + 1))
        spec = [(r, proposals, len(sample_indices) + first) for r, proposals, first in spec]
        sample_indices.extend(spec_rows)
        cu = [0]
        for s in prefills:
            cu.append(cu[-1] + s.num_new_tokens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=len(decode_rows),
            decode_block_tables=self._block_table(decode_rows),
            decode_seq_lens=self._tensor(decode_lens, torch.int32),
            decode_max_seq_len=max(decode_lens, default=0),
            prefill_block_tables=self._block_table(prefills),
            prefill_seq_lens=self._tensor([s.start + s.num_new_tokens for s in prefills],
                                          torch.int32),
            prefill_cu_seqlens_q=self._tensor(cu, torch.int32),
            prefill_max_q_len=max((s.num_new_tokens for s in prefills), default=0),
        )
        ordered = decodes + prefills
        lora = batch_of([s.request.lora for s in ordered], [s.num_new_tokens for s in ordered],
                        self.device if self.plan.attention == "triton" else None)
        return ModelInput(self._tensor(input_ids, torch.int64),
                          self._tensor(positions, torch.int64), meta,
                          self._tensor(sample_indices, torch.int64), sample_requests,
                          tuple(spec), tuple(prompt_rows), tuple(pooled), lora)

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_table(self, group: list[ScheduledRequest]) -> torch.Tensor:
        """[len(group), max blocks] int32, padded with block 0 (never read past seq_len)."""
        width = max((len(s.request.block_ids) for s in group), default=0)
        rows = [s.request.block_ids + [0] * (width - len(s.request.block_ids)) for s in group]
        return self._tensor(rows, torch.int32).view(len(group), width)


def _takes_lora(model) -> bool:
    """LoRA rows can be added to every projection of this model (op by op and in the layers
    op): none of its gate/up applies silu in the matmul (bf16 dense panels), whose output
    then has no gate and up columns to add to."""
    return not any(getattr(layer.mlp, "silu_in_matmul", False) for layer in model.layers)
