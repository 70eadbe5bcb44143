import sys

from workers.engine.cli import main

sys.exit(main())
