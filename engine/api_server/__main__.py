import sys

from engine.api_server.server import main

sys.exit(main())
