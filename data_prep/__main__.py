"""`python -m data_prep ...`: see data_prep/cli.py or `python -m data_prep --help`."""

import sys

from data_prep.cli import main

sys.exit(main())
