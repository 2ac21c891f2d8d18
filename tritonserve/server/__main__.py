"""python -m tritonserve.server [--model PATH] [--host 127.0.0.1] [--port 8000] [engine options]"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
from dataclasses import fields

from aiohttp import web

from tritonserve.engine import LLMEngine
from tritonserve.engine.parallel import exit_process
from tritonserve.engine.tp_runner import serve_rank
from tritonserve.engine.config import (CLI_DECODE_MODES, DTYPE_CHOICES, KV_CACHE_DTYPES,
                                       POOLING_CHOICES, QUANTIZATIONS, CacheConfig, EngineConfig,
                                       SchedulerConfig, SpeculativeConfig)
from tritonserve.engine.limits import RequestLimits
from tritonserve.engine.models.gguf import SERVED as GGUF_SERVED
from tritonserve.engine.models import HelpFormatter, supported_models
from tritonserve.engine.speculative import METHODS as SPECULATIVE_METHODS
from tritonserve.engine.llm import build_config

from .app import build_app, drain
from .common import STATE
from .config import ServerConfig
from .dp_engine import DataParallelEngine
from .harmony import PARSER as HARMONY, TOOL_PARSER as HARMONY_TOOLS
from .reasoning import PARSERS as REASONING_PARSERS
from .router import POLICIES
from .tool_parsers import PARSERS as TOOL_PARSERS


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every default is read from the config dataclasses: none is written here again."""
    e, c, q, v, sp = EngineConfig, CacheConfig, SchedulerConfig, ServerConfig, SpeculativeConfig
    backends = ["auto", "torch", "triton"]
    p = argparse.ArgumentParser(prog="tritonserve serve", epilog=supported_models(),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=e.model,
                   help="local HF folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--host", default=v.host)
    p.add_argument("--port", type=int, default=v.port)
    p.add_argument("--device", default=e.device)
    p.add_argument("--dtype", default=e.dtype, choices=DTYPE_CHOICES,
                   help="auto: the model's dtype, float32 on a CPU without native bf16")
    p.add_argument("--block-size", type=int, default=c.block_size)
    p.add_argument("--num-blocks", type=int, default=c.num_blocks)
    p.add_argument("--kv-cache-memory", "--cache-bytes", dest="cache_bytes", type=int,
                   default=c.cache_bytes, help="KV cache bytes, all layers (default: sized "
                   "from free memory; ignored with --num-blocks)")
    p.add_argument("--gpu-memory-utilization", type=float, default=c.gpu_memory_utilization,
                   help="CUDA: the share of device memory for weights, activations and cache")
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=not c.enable_prefix_caching)
    p.add_argument("--kv-cache-dtype", default=c.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; int8: each token's K/V rows as int8 codes "
                   "with a scale each (1.9x the tokens of a bf16 cache, 3.8x of fp32)")
    p.add_argument("--prefix-cache-dir", default=c.prefix_cache_dir,
                   help="a folder for the prefix cache's second tier: full KV blocks written "
                   "there behind the engine, read back on a miss, kept across restarts")
    p.add_argument("--prefix-cache-disk-gb", type=float, default=c.prefix_cache_disk_gb,
                   help="the most the prefix cache folder holds (least recently used files go)")
    p.add_argument("--max-num-seqs", type=int, default=q.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=q.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=q.max_model_len)
    p.add_argument("--max-prompt-only-tokens", type=int, default=q.max_prompt_only_tokens,
                   help="while a request decodes, the tokens of a step that embedding and "
                   "scoring requests (max_tokens 0) may take")
    p.add_argument("--max-loras", type=int, default=q.max_loras,
                   help="LoRA adapters the running requests may hold (a request of another "
                   "waits until one's requests have ended)")
    p.add_argument("--prompt-only-share", type=float, default=q.prompt_only_share,
                   help="while a request decodes, the share of the engine's time embedding "
                   "and scoring requests may take (1: no time rule)")
    p.add_argument("--long-prefill-tokens", type=int, default=q.long_prefill_tokens,
                   help="while a request decodes, the most tokens a step computes of a prompt "
                   "longer than this (the streams beside it wait for each chunk; default: 256 "
                   "on the CPU, no cap on CUDA)")
    p.add_argument("--priority-step-tokens", type=int, default=q.priority_step_tokens,
                   help="for --priority-window-s after a request of priority p arrives, the "
                   "tokens of worse priority a step computes (default: 8 on the CPU, no cap "
                   "on CUDA)")
    p.add_argument("--priority-window-s", type=float, default=q.priority_window_s)
    p.add_argument("--attention-backend", default=e.attention_backend, choices=backends)
    p.add_argument("--sampler-backend", default=e.sampler_backend, choices=backends)
    p.add_argument("--load-format", default=e.load_format, choices=["safetensors", "dummy"])
    p.add_argument("--quantization", "-q", default=e.quantization, choices=QUANTIZATIONS,
                   help=f"gguf: a GGUF model's quantized blocks as they are "
                   f"({', '.join(GGUF_SERVED)}; another type is refused); "
                   "compressed-tensors: a W4A16 "
                   "/ W8A16 checkpoint's codes; int4 (-g64, -g128) / int8: quantized at load; "
                   "none: dense weights; auto: a GGUF model's blocks (other types dense) or a "
                   "compressed checkpoint's codes on the CPU with the C++ library")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=e.tensor_parallel_size,
                   help="ranks the model is split across (gloo on the CPU, NCCL on CUDA); "
                   "under torchrun the ranks are its processes (RANK > 0 runs a worker)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=v.data_parallel_size,
                   help="engine processes behind this server, each with its share of the "
                   "cores (and its own --tensor-parallel-size ranks)")
    p.add_argument("--data-parallel-routing", default=v.data_parallel_routing,
                   choices=POLICIES, help="prefix: the engine holding the longest cached "
                   "prefix of the prompt, unless it is much busier than the least loaded; "
                   "least-tokens: fewest outstanding tokens; random")
    p.add_argument("--speculative-method", default=sp.method, choices=SPECULATIVE_METHODS,
                   help="ngram: proposals looked up in the request's own tokens, verified in "
                   "one step (greedy token-identical, sampling exact); off by default")
    p.add_argument("--num-speculative-tokens", type=int, default=sp.num_speculative_tokens)
    p.add_argument("--ngram-min", type=int, default=sp.ngram_min)
    p.add_argument("--ngram-max", type=int, default=sp.ngram_max)
    p.add_argument("--speculative-max-batch", type=int, default=sp.max_batch,
                   help="a step speculates only while at most this many requests run")
    p.add_argument("--speculative-min-acceptance", type=float, default=sp.min_acceptance,
                   help="a request whose share of accepted proposals falls below this "
                   "stops proposing for ~10 steps (0: always propose)")
    p.add_argument("--decode-mode", default=e.decode_mode, choices=CLI_DECODE_MODES,
                   help="decode steps: auto (CUDA graphs on CUDA; on the CPU the layer stack as "
                   "one C++ op in fp32 and bf16, torch.compile where that op does not take the "
                   "model), eager, layers, compile, cudagraph, compile+cudagraph; the start-up "
                   "line and /version name the plan and why")
    p.add_argument("--decode-buckets", type=_sizes, default=e.decode_buckets,
                   help="comma-separated batch sizes the decode mode builds (default: 1,2,4, "
                   "then multiples of 8 up to --max-num-seqs)")
    p.add_argument("--enforce-eager", dest="decode_mode", action="store_const", const="eager",
                   help="every step op by op (as --decode-mode eager)")
    p.add_argument("--max-waiting", type=int, default=v.max_waiting,
                   help="waiting requests beyond this get HTTP 503 at once")
    p.add_argument("--max-body-bytes", type=int, default=v.max_body_bytes,
                   help="request bodies larger than this get HTTP 413")
    p.add_argument("--grace-period", type=float, default=v.grace_period,
                   help="seconds SIGTERM lets running streams finish")
    p.add_argument("--seed", type=int, default=e.seed)
    p.add_argument("--api-key", default=os.environ.get("TRITONSERVE_API_KEY", v.api_key),
                   help="the key every route but the probes wants (Authorization: Bearer "
                   "KEY); default $TRITONSERVE_API_KEY, else none")
    p.add_argument("--auth-probes", action="store_true", default=v.auth_probes,
                   help="the key guards /health, /metrics and /version too")
    p.add_argument("--allowed-origins", type=_names, default=v.allowed_origins,
                   help="comma-separated origins browsers may call from (CORS); * for any")
    p.add_argument("--step-timeout", type=float, default=v.step_timeout,
                   help="seconds a step may run before the watchdog ends the engine (every "
                   "stream gets an error event, /health 503, exit 1); default the larger of 60 "
                   "and 20x the slowest step seen; 0: off")
    p.add_argument("--chat-template", default=v.chat_template,
                   help="a Jinja file replacing the tokenizer's chat template (requests can "
                   "never send one)")
    p.add_argument("--chat-template-timeout", type=float, default=v.chat_template_timeout,
                   help="seconds one render of the chat template may take (then a 400)")
    p.add_argument("--reasoning-parser", default=v.reasoning_parser,
                   choices=("auto", "none", *REASONING_PARSERS, HARMONY),
                   help="split <think> reasoning into reasoning_content; auto: what the chat "
                   "template asks for (Qwen3's enable_thinking: qwen3; DeepSeek-R1: deepseek_r1; "
                   f"gpt-oss's harmony channels: {HARMONY})")
    p.add_argument("--tool-call-parser", default=v.tool_call_parser,
                   choices=("auto", *TOOL_PARSERS, HARMONY_TOOLS),
                   help="the format tool calls are parsed from with tool_choice auto; auto: "
                   f"the chat template's (hermes when it says nothing; {HARMONY_TOOLS} for "
                   "gpt-oss's harmony format)")
    p.add_argument("--responses-store", type=int, default=v.responses_store,
                   help="responses kept in memory for GET /v1/responses/{id} and "
                   "previous_response_id (the least recently used dropped first)")
    p.add_argument("--lora-modules", nargs="+", default=e.lora_modules,
                   metavar="NAME=PATH", help="LoRA adapters (PEFT folders or llama.cpp GGUF "
                   "LoRA files) served beside the base; a request names one by `model`")
    p.add_argument("--allow-runtime-lora", action="store_true", default=v.allow_runtime_lora,
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and "
                   "unload adapters at run time (the body names a folder this server reads)")
    p.add_argument("--max-lora-rank", type=int, default=e.max_lora_rank,
                   help="the largest rank an adapter may have")
    p.add_argument("--pooling", default=e.pooling, choices=POOLING_CHOICES,
                   help="how /v1/embeddings pools a prompt's hidden states; auto: as the "
                   "checkpoint's sentence-transformers modules say (1_Pooling), else the last "
                   "token, normalised")
    p.add_argument("--served-model-name", nargs="+", type=str, default=v.served_model_name,
                   help="the names requests may use (the first is reported); default the "
                   "model folder's name (its path is taken too, never shown)")
    limits = p.add_argument_group("request limits", "bounds on a request's input whose cost "
                                  "grows with it (engine/limits.py); past one, a 400 naming "
                                  "the field")
    for f in fields(RequestLimits):
        limits.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                            default=f.default, help=f"{f.metadata['help']} (default "
                            f"{f.default:g})")
    return p.parse_args(argv)


def server_config(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    values["served_model_name"] = tuple(values["served_model_name"])
    return ServerConfig(**values)


def build_engine(args: argparse.Namespace) -> LLMEngine | DataParallelEngine:
    """One engine in this process, or --data-parallel-size engine processes behind it."""
    if args.data_parallel_size > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("data_parallel_size > 1 runs its engines on this machine; under "
                             "torchrun use --tensor-parallel-size alone")
        return DataParallelEngine(engine_config(args), args.data_parallel_size,
                                  args.data_parallel_routing, args.max_waiting,
                                  tuple(args.served_model_name))
    return LLMEngine(engine_config(args))


def engine_config(args: argparse.Namespace):
    return (build_config(
        args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks, cache_bytes=None if args.num_blocks else args.cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype, prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_gb=args.prefix_cache_disk_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_prompt_only_tokens=args.max_prompt_only_tokens,
        prompt_only_share=args.prompt_only_share, long_prefill_tokens=args.long_prefill_tokens,
        priority_step_tokens=args.priority_step_tokens, priority_window_s=args.priority_window_s,
        max_loras=args.max_loras,
        attention_backend=args.attention_backend, sampler_backend=args.sampler_backend,
        load_format=args.load_format, quantization=args.quantization,
        decode_mode=args.decode_mode, tensor_parallel_size=args.tensor_parallel_size,
        decode_buckets=args.decode_buckets, seed=args.seed,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max, speculative_max_batch=args.speculative_max_batch,
        speculative_min_acceptance=args.speculative_min_acceptance, pooling=args.pooling,
        lora_modules=tuple(args.lora_modules), max_lora_rank=args.max_lora_rank,
        enable_lora=args.allow_runtime_lora,
        **{f.name: getattr(args, f.name) for f in fields(RequestLimits)}))


async def serve_http(app: web.Application, args: argparse.Namespace,
                     stop: asyncio.Event) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    card = app[STATE].engine.card
    engines = f"{card.engines} engines; " if card.engines > 1 else ""
    kv = "" if card.kv_cache_dtype == "auto" else f" ({card.kv_cache_dtype})"
    logging.info("serving %s on http://%s:%d (%s%s; %s; %s; %d KV blocks%s of %d tokens)",
                 card.name, args.host, args.port, engines, card.dtype, card.plan.describe(),
                 card.kernels, card.num_kv_blocks, kv, card.block_size)
    print(f"READY http://{args.host}:{args.port}", flush=True)
    await stop.wait()
    logging.info("draining (grace period %.1f s)", args.grace_period)
    await drain(app, args.grace_period)
    await runner.cleanup()  # stops the engine loop on the main thread


STALL_EXIT_DELAY = 1.0  # seconds the streams' error events get to reach their clients


def main(argv: list[str] | None = None) -> int:
    """The engine steps on the main thread (see server/async_engine.py); the event loop runs
    in a second thread. SIGTERM / SIGINT start the drain. Exit status: 0 after a drain, 1 when
    the engine died (every stream has its error event by then), 2 for a bad option. A
    tensor-parallel rank (--tensor-parallel-size > 1) ends the process here (exit_process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0 and args.tensor_parallel_size > 1:  # torchrun's other ranks: workers
        exit_process(serve_rank(engine_config(args), rank))
    try:
        config = server_config(args)
        engine = build_engine(args)
        app = build_app(engine, config, engine_thread=False)
    except (ValueError, FileNotFoundError) as exc:  # a bad option, model folder or template
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # What start-up built lives as long as the process: out of the collector's sight, the
    # per-step garbage collections stay short (as vLLM does) and exit skips a ~1.5 s final
    # sweep of the model, tokenizers and library modules.
    gc.collect()
    gc.freeze()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def on_stall(reason: str) -> None:  # the main thread is stuck in the step: end the process
        # once the error events are written (the watchdog's thread: whatever the loop does)
        threading.Timer(STALL_EXIT_DELAY, os._exit, (1,)).start()

    app[STATE].on_stall = on_stall

    def run_loop() -> None:
        try:
            loop.run_until_complete(serve_http(app, args, stop))
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            failure.append(exc)
            app[STATE].engine.stop()

    def on_signal(signum, frame) -> None:
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    http_thread = threading.Thread(target=run_loop, name="http", daemon=True)
    http_thread.start()
    async_engine = app[STATE].engine
    async_engine.run()
    if async_engine.dead is not None:  # drain what is left, then let a supervisor restart us
        loop.call_soon_threadsafe(stop.set)
    http_thread.join(timeout=30)
    if failure:
        raise failure[0]
    code = 1 if async_engine.dead is not None else 0
    if args.tensor_parallel_size > 1:  # a rank: see exit_process
        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
