import sys

from detector.cli import main

sys.exit(main())
