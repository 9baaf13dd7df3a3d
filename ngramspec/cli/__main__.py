import sys

from ngramspec.cli import main

sys.exit(main())
