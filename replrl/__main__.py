"""`python -m replrl ...` is the `replrl` command (for `accelerate launch -m replrl train ...`)."""

import sys

from replrl.cli import main

sys.exit(main())
