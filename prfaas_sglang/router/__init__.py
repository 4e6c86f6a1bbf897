"""The global scheduler (issue #5). ``policy`` and ``threshold`` are pure and shared with
the planner and the simulator; the HTTP front end arrives with the rest of the issue."""
