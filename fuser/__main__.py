import sys

from fuser.tools.cli import main

sys.exit(main())
