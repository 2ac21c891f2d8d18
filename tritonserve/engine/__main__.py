"""tritonserve generate --model PATH --prompt TEXT [--max-tokens N] [--temperature T]"""
from __future__ import annotations

import argparse
import sys

from .config import CLI_DECODE_MODES, DTYPE_CHOICES, EngineConfig
from .llm import LLM
from .models import HelpFormatter, supported_models
from .sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonserve")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation", epilog=supported_models(),
                         formatter_class=HelpFormatter)
    gen.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPE_CHOICES)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--decode-mode", default=EngineConfig.decode_mode, choices=CLI_DECODE_MODES)
    gen.add_argument("--enforce-eager", dest="decode_mode", action="store_const", const="eager",
                     help="no start-up compile (a one-off generation rarely repays it)")
    args = parser.parse_args(argv)
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype,
                  decode_mode=args.decode_mode)
    except (ValueError, FileNotFoundError) as exc:  # a model we cannot serve, a bad option
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                     tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    for out in llm.generate(prompts, params):
        print(f"--- {out.finish_reason.value}, {len(out.token_ids)} tokens")
        print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
