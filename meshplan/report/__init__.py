"""Reports (layer 14): readers of a :class:`~meshplan.plan.Plan` and of search results: JSON
(:mod:`.json_out` for the plan, :mod:`.json_docs` for the other commands, each with its
schema file in ``meshplan/schemas/``), terminal text (:mod:`.text`, :mod:`.memory`,
:mod:`.place_text`, :mod:`.search`), the memory plot (:mod:`.memory_plot`) and the HTML
pages (:mod:`.html` pieces, :mod:`.html_pages` plan and search pages).
"""

__all__ = ["html", "html_pages", "json_docs", "json_out", "memory", "memory_plot", "place_text", "search", "text"]
