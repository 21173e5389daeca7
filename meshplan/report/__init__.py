"""Reports: readers of a :class:`~meshplan.plan.Plan` (JSON and terminal text)."""
