"""The supervisor: launches the plan, tags every line, restarts what fails."""
