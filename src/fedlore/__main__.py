"""``python -m fedlore``: the ``fedlore`` command (:func:`fedlore.console.main`)."""

import sys

from fedlore.console import main

sys.exit(main())
