"""Reports (layer 14): readers of a :class:`~meshplan.plan.Plan` and of search results: JSON
(:mod:`.json_out` for the plan, :mod:`.json_docs` for the other commands, each with its
schema file in ``meshplan/schemas/``), terminal text (:mod:`.text`, its tables' per-layer counts
:mod:`.layer_counts`, :mod:`.memory`, :mod:`.place_text`, :mod:`.search` with :mod:`.search_lines`;
the search's progress bar :mod:`.progress`), the memory plot (:mod:`.memory_plot`) and the HTML pages (:mod:`.html`
pieces, :mod:`.html_pages` plan and search pages).
"""

__all__ = ["html", "html_pages", "json_docs", "json_out", "layer_counts", "memory", "memory_plot", "place_text",
           "progress", "search", "search_lines", "text"]

from rich.markup import escape

from meshplan.errors import printable


def shown(text) -> str:
    """``text`` from input (a path, a name) for a rich console: control characters and escape
    sequences escaped (:func:`meshplan.errors.printable`), rich markup (``[red]``) escaped.

    >>> shown("x\\x1b[2J[red]y.toml")
    'x\\\\x1b[2J\\\\[red]y.toml'
    """
    return escape(printable(str(text)))
