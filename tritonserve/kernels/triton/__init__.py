"""The Triton kernels (GPU; on CPU tensors they need TRITON_INTERPRET=1, as the tests run
them), each with the contract and signature of its plain-torch twin in kernels/reference.py."""
from ._common import num_sms
from .decode_attention import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_splits,
                               paged_decode_attention)
from .fused_elementwise import add_rms_norm, silu_and_mul
from .kv_cache_write import store_kv_cache
from .prefill_attention import paged_prefill_attention
from .sampling import sample

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv_cache",
           "sample", "add_rms_norm", "silu_and_mul", "choose_num_splits", "num_sms", "MAX_SPLITS", "MIN_TOKENS_PER_SPLIT"]
