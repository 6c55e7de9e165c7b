"""`python -m ringserve.cli`: the `ringserve` command."""

import sys

from ringserve.cli.main import main

sys.exit(main())
