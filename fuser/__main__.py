import sys

from fuser.cli import main

sys.exit(main())
