import sys

from mate.tuning.cli import main

sys.exit(main())
