import sys

from kvpush.tools.tp_outputs.run import main

sys.exit(main())
