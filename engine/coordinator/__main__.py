import sys

from engine.process import die_with_supervisor

die_with_supervisor()

from engine.coordinator.coordinator import main  # noqa: E402

sys.exit(main())
