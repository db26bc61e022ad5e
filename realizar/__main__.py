"""``python -m realizar`` is the ``realizar`` command."""

import sys

from realizar.cli import main

sys.exit(main())
