"""Paged-attention kernels: Triton on CUDA, a plain-torch reference elsewhere (see docs/kernels.md)."""

from tokenmill.kernels import reference
from tokenmill.kernels.ops import paged_attention_decode, paged_attention_prefill, store_kv
from tokenmill.kernels.validate import check_seq_lens_fit

__all__ = ["check_seq_lens_fit", "paged_attention_decode", "paged_attention_prefill", "reference", "store_kv"]
