from .arch import ModelArch
from .decoder import DecoderForCausalLM, ForwardContext
from .family import (FAMILIES, HelpFormatter, family_for, supported_architectures,
                     supported_gguf_architectures, supported_models)
from .loader import WeightLoadError, build_model, load_weights

__all__ = ["FAMILIES", "HelpFormatter", "ModelArch", "DecoderForCausalLM", "ForwardContext", "WeightLoadError",
           "build_model", "family_for", "load_weights", "supported_architectures",
           "supported_gguf_architectures", "supported_models"]
