import sys

from engine.process import die_with_supervisor

die_with_supervisor()  # before the heavy imports: a supervisor killed meanwhile takes us along

from engine.core.engine_core_proc import main  # noqa: E402

sys.exit(main())
