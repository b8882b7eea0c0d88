import sys

from detector.cli.main import main

sys.exit(main())
