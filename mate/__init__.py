"""mate: TileLang kernels for sparse attention, tuned per GPU target.

Every entrypoint takes backend="tilelang" (native kernels, the default; raises
ValueError for anything unsupported) or backend="reference" (the PyTorch FP32
oracle, any device). Under torch.compile each call is one torch.ops.mate op.
"""

from mate import _ops
from mate._debug import debug_checks  # opt-in value checks of the metadata (also MATE_DEBUG_CHECKS=1)

# The stages' entrypoints, registered as torch.library ops (torch.ops.mate.*) for torch.compile:
# mate/_ops.py makes them and lists them in its __all__.
from mate._ops import *  # noqa: F403

__all__ = sorted(["debug_checks", *_ops.__all__])
__version__ = "0.1.0"
