import sys

from engine.core.engine_core_proc import main

sys.exit(main())
