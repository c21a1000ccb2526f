"""`python -m cnrstore ...` runs the command line, like the `cnrstore` script."""

import sys

from cnrstore.cli.app import main

sys.exit(main())
