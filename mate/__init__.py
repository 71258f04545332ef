"""mate: TileLang kernels for sparse attention, tuned per GPU target.

Every entrypoint takes backend="tilelang" (native kernels, the default; raises
ValueError for anything unsupported) or backend="reference" (the PyTorch FP32
oracle, any device).
"""

from mate.qsa.indexer import qsa_indexer_mqa_score, qsa_mqa, qsa_mqa_decode, qsa_mqa_prefill

__all__ = ["qsa_indexer_mqa_score", "qsa_mqa", "qsa_mqa_decode", "qsa_mqa_prefill"]
__version__ = "0.1.0"
