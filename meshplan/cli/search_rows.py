"""The rows ``meshplan search --export`` writes: row N of the top table, or row 1's mesh at another
setting by its label (``1b``), as the config of a framework's search writes it, and the one-line
errors of a row the search did not list or a format refuses (:mod:`meshplan.cli.search_cmds`,
:mod:`meshplan.cli.search_frameworks_cmd`)."""

from __future__ import annotations

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.common import FORMATS
from meshplan.interop.search_export import missing_variant, search_row_refusal, search_variant_refusal
from meshplan.plan_runtime import export_refusals
from meshplan.search.candidate import as_written, candidate_config
from meshplan.search.driver import SearchResult
from meshplan.search.rank import variant_label


def export_choice(result: SearchResult, pick: tuple[int, str], to: str) -> tuple[Config, str]:
    """The config ``search --export`` writes and its words for the header (``row 2``, ``variant
    1b``): row ``pick[0]`` of the top table, or, with a letter, row
    1's variant of that label (:func:`meshplan.search.rank.variant_label`), each candidate as
    :func:`~meshplan.search.candidate.candidate_config` gives it, with the user's [training] keys
    (:func:`~meshplan.search.candidate.as_written`); a row or label the search did not list, or one
    ``to`` cannot write, a one-line error naming --export."""
    n, letter = pick
    if n > len(result.top):
        raise ConfigError("--export", missing_row(n, len(result.top)))

    def config_of(e) -> Config:
        return as_written(candidate_config(result.config, result.candidates, e.index), result.config)

    if letter:
        labels = [variant_label(k) for k in range(len(result.variants))]
        label = f"{n}{letter}"
        if label not in labels:
            raise ConfigError("--export", missing_variant(label, labels, len(result.top)))
        row = config_of(result.variants[labels.index(label)])
        if (refusal := search_variant_refusal(label, row, to, refused_of)) is not None:
            raise ConfigError("--export", refusal)
        return row, f"variant {label}"
    rows = [config_of(e) for e in result.top]
    if (refusal := search_row_refusal(n, rows, to, refused_of)) is not None:  # naming the first row it takes
        raise ConfigError("--export", refusal)
    return rows[n - 1], f"row {n}"


def refused_of(cfg) -> dict[str, tuple[str, ...]]:
    """Every format's export refusals of ``cfg`` (:func:`meshplan.plan_runtime.export_refusals`)."""
    return {t: export_refusals(cfg, t) for t in FORMATS}


def missing_row(k: int, rows: int) -> str:
    """Why ``--export k`` has no row after the search (``k`` <= --top was checked before it): the
    search listed only ``rows``, every distinct mesh it found to fit (rows are distinct meshes), so
    a higher --top lists no more.

    >>> missing_row(7, 1).split("; ")[0]
    '7: the search lists 1 row(s), every distinct mesh it found to fit, so --top lists no more'
    """
    return (f"{k}: the search lists {rows} row(s), every distinct mesh it found to fit, so --top lists no more; a "
            f"mesh's other settings are on the line under the table (--json top_variants), row 1's labelled 1a, 1b, "
            f"1c: export a rank up to {rows} or such a label, or narrow [search] (e.g. sharding) so that the "
            f"setting you want is a row's")
