"""Engine configuration: frozen dataclasses, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .limits import RequestLimits

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


DTYPE_CHOICES = ("auto", *_DTYPES)  # auto: the model's dtype where the device runs it (dtype.py)

# How a decode-only step runs; engine/plan.py resolves auto and says why. static (static
# buffers op by op, the CUDA-graph path minus the capture) is a test fixture: not in CLI_MODES.
DECODE_MODES = ("auto", "eager", "static", "compile", "cudagraph", "compile+cudagraph", "layers")
CLI_DECODE_MODES = tuple(m for m in DECODE_MODES if m != "static")
# Projection weights: gguf serves a GGUF file's quantized blocks as they are
# (engine/models/gguf.py), compressed-tensors a W4A16 / W8A16 checkpoint's codes
# (engine/models/compressed.py); int4 (groups of 32; -g64, -g128) / int8 quantize a
# checkpoint's weights at load (kernels/quant_layout.py: quantize); none the dense weights (a
# GGUF's dense conversion, a compressed checkpoint dequantized); auto: engine/plan.py decides
# and says why.
QUANTIZATIONS = ("auto", "none", "gguf", "compressed-tensors", "int8", "int4", "int4-g64",
                 "int4-g128")


# how an embedding pools a prompt's hidden states (engine/pooling.py); auto: as the checkpoint
# says, else the last token
POOLING_CHOICES = ("auto", "last", "mean", "cls")


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache size: `num_blocks`, or `cache_bytes` (all layers, K and V), or neither:
    sized from the device's memory (engine/memory.py)."""

    block_size: int = 16
    num_blocks: int | None = None
    cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: the share of device memory this engine takes
    enable_prefix_caching: bool = True
    # a second tier for the prefix cache (engine/disk_cache.py): full blocks written there
    # behind the engine, read back on a miss, kept across restarts; bounded to this many GiB
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float = 16.0
    # auto: the model's dtype; int8: each (token, KV head) row as head_dim int8 codes and its
    # fp32 scale (absmax / 127), written by the store, read by every attention path
    # (kernels/reference.py's quantize_kv / dequantize_kv): 1.9x the tokens of a bf16 cache
    # in the same memory (head_dim 64: 68 bytes a row against 128), 3.8x of an fp32 one
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (16, 32):  # what the kernels are tested with
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be > 0, got {self.cache_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if not self.prefix_cache_disk_gb > 0:
            raise ValueError(f"prefix_cache_disk_gb must be > 0, got {self.prefix_cache_disk_gb}")
        if self.prefix_cache_dir and not self.enable_prefix_caching:
            raise ValueError("prefix_cache_dir is the prefix cache's second tier: it needs "
                             "prefix caching (drop --no-prefix-caching)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # while a request decodes, the tokens of a step that requests computing only their prompt
    # (embeddings, scoring: max_tokens 0) may take: what one such step stalls the streams for
    # (256 tokens: ~0.55 s on 2 cores, 64: ~0.14 s), and the share of the engine's time they
    # may take then: a step with their tokens comes only once the decode steps since the last
    # one have earned its time (1.0: no time rule). Beside embedding batches 4 streams' TPOT
    # was 29x alone with the cap at 256 and no time rule, 2.0x with the share at 0.5, 1.8x at
    # 64 tokens (embeddings 372, 330, 305 tokens/s; docs/benchmarks.md, "Embeddings beside
    # generation")
    max_prompt_only_tokens: int = 64
    prompt_only_share: float = 0.5
    # while another request decodes, a prompt longer than this computes at most this many
    # tokens a step (vLLM's long_prefill_token_threshold): each chunk of a long prompt is a
    # step every stream beside it waits for. None: 256 on the CPU, no cap on CUDA (a chunk
    # costs ms there). Beside 4 streams of SmolLM2 on 2 cores (TTFT / the streams' median gap
    # while it prefilled): an 8,000-token prompt 57 s / 15.5 s with the whole budget (2048)
    # a step, 40-44 s / 2.5 s at 512, 46-50 s / 1.4 s at 256, 48 s / 0.7-0.8 s at 128; a
    # 1,000-token one 2.10 / 2.10, 2.47 / 1.24, 2.59 / 0.66, 2.68 / 0.33 s
    # (docs/benchmarks.md, long context)
    long_prefill_tokens: int | None = None
    # for priority_window_s after a request of priority p arrives, a step computes at most this
    # many tokens of worse priority (running requests first, least recently run first; new
    # ones wait), so a request arriving then waits for a short step in flight, not a full one.
    # None: 8 on the CPU, where a step's time grows with its rows (SmolLM2 Q4_1, 2 cores: 9 ms
    # at 1 row, 23 at 8, 168 at 64; beside 64 low streams the probe's TTFT was 1.6x idle at
    # 8, 2.5x at 16, 5.8x uncapped; docs/benchmarks.md, "Priority under a full cache"); no
    # cap on CUDA, where 64 rows cost about what 8 do
    priority_step_tokens: int | None = None
    priority_window_s: float = 30.0
    # LoRA adapters the running requests may hold (vLLM's --max-loras, SGLang's
    # max_loras_per_batch, 8): each adds its A and B to the bytes a step reads (a rank-16
    # adapter of SmolLM2: 9.8 MB in bf16, ~10 % of the Q4 blocks). A waiting request of another
    # adapter waits until one's requests have all ended (as vLLM's); requests behind it, and
    # the base's, pass it
    max_loras: int = 8

    def long_prefill_tokens_on(self, device: str) -> int | None:
        """long_prefill_tokens on `device` (None: no cap)."""
        if self.long_prefill_tokens is not None:
            return self.long_prefill_tokens
        return 256 if device == "cpu" else None

    def step_tokens_under_priority(self, device: str) -> int | None:
        """priority_step_tokens on `device` (None: no cap)."""
        if self.priority_step_tokens is not None:
            return self.priority_step_tokens
        return 8 if device == "cpu" else None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_prompt_only_tokens < 1:
            raise ValueError(f"max_prompt_only_tokens must be >= 1, got "
                             f"{self.max_prompt_only_tokens}")
        if not 0 < self.prompt_only_share <= 1:
            raise ValueError(f"prompt_only_share must be in (0, 1], got "
                             f"{self.prompt_only_share}")
        if self.long_prefill_tokens is not None and self.long_prefill_tokens < 1:
            raise ValueError(f"long_prefill_tokens must be >= 1, got {self.long_prefill_tokens}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.priority_step_tokens is not None and self.priority_step_tokens < 1:
            raise ValueError(f"priority_step_tokens must be >= 1, got {self.priority_step_tokens}")
        if self.priority_window_s < 0:
            raise ValueError(f"priority_window_s must be >= 0, got {self.priority_window_s}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output "
                             f"token), got {self.max_model_len}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """engine/speculative.py: n-gram proposals verified in one step."""

    method: str | None = None  # None (off) | "ngram"
    num_speculative_tokens: int = 3  # K proposals a step
    # the shortest suffix looked up: with a 4-row verification step at ~1.15x a 1-row one,
    # one-token matches pay (embedded model, spec_figures.sh, two runs each: copy greedy
    # 1.70 / 1.75x at 2, 1.91 / 1.83x at 1; random words at temperature 1 0.93 / 0.94x at 2,
    # 0.97 / 1.00x at 1, the pause below min_acceptance holding the wrong proposals back)
    ngram_min: int = 1
    ngram_max: int = 4  # the longest, tried first
    # a step speculates only while at most this many requests decode: past it a step reads
    # the weights for many rows already and extra rows cost compute (docs/benchmarks.md)
    max_batch: int = 4
    # a request whose running share of accepted proposals falls below this stops proposing
    # for a while (engine/speculative.py); 0: always propose
    min_acceptance: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram"):
            raise ValueError(f"speculative_method must be ngram (or unset), got "
                             f"{self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= "
                             f"ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got "
                             f"{self.min_acceptance}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF folder or .gguf file; None: the embedded SmolLM2
    device: str = "cpu"
    dtype: str = "auto"  # resolved by LLMEngine before anything reads torch_dtype
    attention_backend: str = "auto"  # auto | torch | triton
    sampler_backend: str = "auto"  # auto | torch | triton
    load_format: str = "safetensors"  # safetensors | dummy
    quantization: str = "auto"  # QUANTIZATIONS
    decode_mode: str = "auto"  # DECODE_MODES; --enforce-eager sets eager
    # batch sizes a non-eager decode mode builds (vLLM's cudagraph capture sizes); empty:
    # 1, 2, 4, then every multiple of 8 up to max_num_seqs. Larger decode steps run eager.
    decode_buckets: tuple[int, ...] = ()
    # ranks a model is split across (engine/parallel.py): column-parallel qkv and gate/up,
    # row-parallel o and down, the KV heads and cache per rank; gloo on the CPU, NCCL on CUDA
    tensor_parallel_size: int = 1
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)  # engine/limits.py
    # how an embedding pools the prompt (engine/pooling.py's POOLING_CHOICES); auto: as the
    # checkpoint's sentence-transformers modules say, else last-token
    pooling: str = "auto"
    # LoRA adapters served beside the base (engine/lora.py): "name=path" each (a PEFT folder
    # or a GGUF LoRA file), and the largest rank one may have
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 64
    # adapters may also be loaded at run time (the server's --allow-runtime-lora)
    enable_lora: bool = False

    @property
    def serves_lora(self) -> bool:
        """Adapters may add to the projections: every gate/up keeps its gate and up columns
        (no silu in a bf16 panel's matmul: DecoderForCausalLM.prepack_weights)."""
        return self.enable_lora or bool(self.lora_modules)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        for name in ("attention_backend", "sampler_backend"):
            value = getattr(self, name)
            if value not in ("auto", "torch", "triton"):
                raise ValueError(f"{name} must be auto, torch or triton, got {value!r}")
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {POOLING_CHOICES}, got "
                             f"{self.pooling!r}")
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got "
                             f"{self.decode_mode!r}")
        if "cudagraph" in self.decode_mode and not (torch.device(self.device).type == "cuda"
                                                    and self.use_triton("attention")):
            raise ValueError(f"decode_mode {self.decode_mode!r} needs a CUDA device and the "
                             f"triton attention backend (the torch one reads lengths back to "
                             f"the host), got device {self.device!r}, attention_backend "
                             f"{self.attention_backend!r}")
        if self.decode_mode == "layers" and (torch.device(self.device).type != "cpu"
                                             or self.use_triton("attention")):
            raise ValueError(f"decode_mode 'layers' runs on the CPU with the torch attention "
                             f"backend, got device {self.device!r}, attention_backend "
                             f"{self.attention_backend!r}")
        bad = [b for b in self.decode_buckets
               if isinstance(b, bool) or not isinstance(b, int) or b < 1
               or b > self.scheduler.max_num_seqs]
        if bad:
            raise ValueError(f"decode_buckets must be batch sizes in [1, max_num_seqs "
                             f"{self.scheduler.max_num_seqs}], got {bad}")
        if (isinstance(self.tensor_parallel_size, bool)
                or not isinstance(self.tensor_parallel_size, int)
                or self.tensor_parallel_size < 1):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if self.cache.prefix_cache_dir and self.tensor_parallel_size > 1:
            raise ValueError("prefix_cache_dir is not served with tensor_parallel_size > 1 yet "
                             "(each rank holds its own heads' blocks)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got {self.load_format!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type (torch.int8: rows of codes + scale)."""
        return torch.int8 if self.cache.kv_cache_dtype == "int8" else self.torch_dtype

    def use_triton(self, which: str) -> bool:
        """Triton on CUDA, torch on the CPU, unless forced."""
        choice = getattr(self, f"{which}_backend")
        if choice == "auto":
            return torch.device(self.device).type == "cuda"
        return choice == "triton"
