"""``python -m tunerd`` runs the command line."""

import sys

from tunerd.cli import main

sys.exit(main())
