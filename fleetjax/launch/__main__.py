"""`python -m fleetjax.launch`: the `fleetjax-run` command."""

import sys

from fleetjax.launch import main

sys.exit(main())
