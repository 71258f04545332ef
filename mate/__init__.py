"""mate: TileLang kernels for sparse attention, tuned per GPU target.

Every entrypoint takes backend="tilelang" (native kernels, the default; raises
ValueError for anything unsupported) or backend="reference" (the PyTorch FP32
oracle, any device). Under torch.compile each call is one torch.ops.mate op.
"""

from mate._debug import debug_checks  # opt-in value checks of the metadata (also MATE_DEBUG_CHECKS=1)

# The stages' entrypoints, registered as torch.library ops (torch.ops.mate.*) for torch.compile.
from mate._ops import (
    build_gqa_attn,
    gqa_attention,
    merge_attention_states,
    nsa_selection_attention,
    qsa_indexer_mqa_score,
    qsa_mqa,
    qsa_mqa_decode,
    qsa_mqa_prefill,
    qsa_sparse_attention,
)

__all__ = [
    "build_gqa_attn",
    "debug_checks",
    "gqa_attention",
    "merge_attention_states",
    "nsa_selection_attention",
    "qsa_indexer_mqa_score",
    "qsa_mqa",
    "qsa_mqa_decode",
    "qsa_mqa_prefill",
    "qsa_sparse_attention",
]
__version__ = "0.1.0"
