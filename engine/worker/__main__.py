import sys

from engine.worker.worker_proc import main

sys.exit(main())
