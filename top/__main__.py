"""`python -m top ...` is `kthrottle top ...`."""

import sys

from top.app import main

sys.exit(main())
