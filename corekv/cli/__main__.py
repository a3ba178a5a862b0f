"""``python -m corekv.cli ARGS``: the ``corekv`` command without the console script."""
import sys

from corekv.cli.entry import main

sys.exit(main())
