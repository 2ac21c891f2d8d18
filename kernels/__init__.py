"""Triton kernels of the engine's hot paths. Each public function always launches its Triton
kernel (on CPU tensors that needs TRITON_INTERPRET=1); `kernels.reference` holds plain-torch
versions with the same signatures."""
from . import reference
from ._common import num_sms
from .decode_attention import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_splits,
                               paged_decode_attention)
from .fused_elementwise import add_rms_norm, silu_and_mul
from .kv_cache_write import store_kv_cache
from .prefill_attention import paged_prefill_attention
from .sampling import sample

__all__ = ["reference", "paged_decode_attention", "paged_prefill_attention", "store_kv_cache",
           "sample", "add_rms_norm", "silu_and_mul", "choose_num_splits", "num_sms", "MAX_SPLITS", "MIN_TOKENS_PER_SPLIT"]
