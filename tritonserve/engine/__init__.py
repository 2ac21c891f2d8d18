"""The engine: scheduler, KV-cache manager, model runner, sampler and detokenizer."""
from .config import CacheConfig, EngineConfig, SchedulerConfig
from .errors import EngineDeadError, InvalidRequestError
from .llm import LLM, build_config
from .llm_engine import LLMEngine
from .outputs import (Completion, FinishReason, GenerationStep, RequestOutput, RequestTiming,
                      PromptLogprob, TokenOutput, TopLogprob)
from .sampling_params import SamplingParams

__all__ = ["CacheConfig", "EngineConfig", "SchedulerConfig", "InvalidRequestError",
           "EngineDeadError", "LLM",
           "build_config", "LLMEngine", "Completion", "FinishReason", "GenerationStep",
           "RequestOutput", "RequestTiming", "PromptLogprob", "TokenOutput", "TopLogprob",
           "SamplingParams"]
