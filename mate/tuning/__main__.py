import sys

from tuning.cli import main

sys.exit(main())
