import sys

from zeroinf.cli import main

sys.exit(main())
