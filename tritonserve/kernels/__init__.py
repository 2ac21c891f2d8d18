"""The engine's hot-path kernels. The functions here are the Triton kernels (CUDA; on CPU
tensors they need TRITON_INTERPRET=1, as the tests run them); `cpu_ops` is the C++ library for
x86-64 CPUs (cpu/, built by cpu_build); `reference` holds plain-torch versions with the same
signatures, the oracle both are tested against and the path anywhere else."""
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
