"""Reports (layer 14): readers of a :class:`~meshplan.plan.Plan` and of search results: JSON
(:mod:`.json_out`), terminal text (:mod:`.text`, :mod:`.memory`, :mod:`.place_text`,
:mod:`.search`) and the memory plot (:mod:`.memory_plot`).
"""

__all__ = ["json_out", "memory", "memory_plot", "place_text", "search", "text"]
