"""``python -m storch.demo``: see `storch.demo`."""

import sys

from storch.demo import main

if __name__ == "__main__":
    sys.exit(main())
