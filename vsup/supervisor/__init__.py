"""The supervisor: launches the plan, tags every line, restarts what fails (DESIGN.md sections 2 to 4)."""
