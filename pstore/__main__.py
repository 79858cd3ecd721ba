"""``python -m pstore`` runs the command line."""

import sys

from pstore.cli import main

sys.exit(main())
