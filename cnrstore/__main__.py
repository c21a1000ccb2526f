"""`python -m cnrstore ...` runs the command line, like the `cnrstore` script."""

import sys

from .cli import main

sys.exit(main())
