import sys

from dflash_models.learn.cli import main

sys.exit(main())
