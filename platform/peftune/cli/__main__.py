"""``python -m peftune.cli``: the ``peftune`` command, for a machine where the script is not on the PATH."""

import sys

from peftune.cli.commands import main

sys.exit(main())
