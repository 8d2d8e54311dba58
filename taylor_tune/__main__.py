import sys

from taylor_tune.cli import main

sys.exit(main())
