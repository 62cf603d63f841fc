"""``python -m storch.bench``: see `storch.bench.cli`."""

import sys

from storch.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
