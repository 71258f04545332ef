"""`python -m benchmarks`: the report of benchmarks/run.py."""

import sys
from pathlib import Path

# The scripts import each other by file name (common, bench_*), as they do when run directly.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import main  # noqa: E402

sys.exit(main())
