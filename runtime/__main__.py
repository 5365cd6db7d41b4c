import sys

from epgen.cli import main

sys.exit(main())
