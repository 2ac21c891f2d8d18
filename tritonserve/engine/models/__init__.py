from .arch import SUPPORTED_ARCHITECTURES, ModelArch
from .decoder import DecoderForCausalLM, ForwardContext
from .loader import WeightLoadError, build_model, load_weights

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArch", "DecoderForCausalLM", "ForwardContext",
           "WeightLoadError", "build_model", "load_weights"]
