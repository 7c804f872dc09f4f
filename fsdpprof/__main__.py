import sys

from fsdpprof.cli import main

sys.exit(main())
