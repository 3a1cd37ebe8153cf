"""The roles of a process tree: what every part of vsup calls its processes (pure names, no imports)."""

API_SERVER = "api-server"
ENGINE_CORE = "engine-core"
WORKER = "worker"
COORDINATOR = "coordinator"
ROLES = (API_SERVER, ENGINE_CORE, WORKER, COORDINATOR)
FRONT = "front"  # vsup's own HTTP front before a stock vLLM
COUNTED = (FRONT, *ROLES)  # the roles of the count; others (vLLM's helpers) are counted apart
