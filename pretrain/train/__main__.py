"""`python -m omniloom.pretrain.train` (and `accelerate launch -m omniloom.pretrain.train`)."""

import sys

from .main import main

sys.exit(main())
