"""``python -m clients.cli``: the ``steward`` command."""

import sys

from clients.cli import main

if __name__ == "__main__":
    sys.exit(main())
