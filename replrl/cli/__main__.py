"""`python -m replrl.cli ...`: the `replrl` command, as `python -m replrl ...` is."""

import sys

from replrl.cli import main

sys.exit(main())
