import sys

from specengine.cli import main

sys.exit(main())
