"""``meshplan search --framework a,b``: each framework searched with its own rules and ranked in one
table (:func:`meshplan.search.frameworks.cross_search`), its report, ``--json`` and ``--export N``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import _console, _echo, _refuse_existing, _write_text
from meshplan.cli.interop_cmds import _write_export
from meshplan.cli.loading import _calibrated, _calibration
from meshplan.cli.search_rows import export_choice, missing_row
from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.export_formats import UserFile
from meshplan.report.progress import ProgressBar
from meshplan.report.search_clear import export_warnings
from meshplan.report.search_frameworks import cross_to_dict, print_cross
from meshplan.search.driver import search
from meshplan.search.frameworks import cross_search


@dataclass(frozen=True)
class CrossExport:
    """``--export N --to T -o OUT`` of a search across frameworks: row ``n`` of the one ranking."""

    n: int
    to: str
    out: Path
    config: Path
    user: Optional[UserFile]
    carried: list


def search_frameworks(cfg: Config, names: tuple[str, ...], json_path: Optional[Path], force: bool,
                       calibration, export: Optional[CrossExport] = None) -> None:
    """``search --framework a,b``: each framework searched with its own rules, every row ranked
    together (:func:`meshplan.search.frameworks.cross_search`), the report
    (:func:`meshplan.report.search_frameworks.print_cross`), ``--export N`` of row N (its own
    framework's row, as a search of that framework alone writes it: :func:`~meshplan.cli.search_rows.export_choice`) and
    --json; exit 0 when a row fits, 1 when no framework has one."""
    _refuse_existing(json_path, force, "--json")
    cal = _calibration(calibration, cfg.cluster)
    with ProgressBar() as bar:
        result = cross_search(cfg, names, lambda c, p: search(c, progress=p), bar)
    print_cross(result, _console())
    if export is not None:
        if export.n > len(result.rows):
            raise ConfigError("--export", missing_row(export.n, len(result.rows)))
        row = result.rows[export.n - 1]
        k = row.result.top.index(row.exact) + 1  # its row in its own framework's search
        try:
            written, _ = export_choice(row.result, (k, ""), export.to)
        except ConfigError as e:
            raise ConfigError(e.field, f"row {export.n} is {row.framework}'s row {k}: {e.message}") from None
        _write_export(written, export.to, export.out, f"search {export.config} row {export.n} ({row.framework})",
                      force, export.user, [*export.carried, *export_warnings(row.result, (k, ""))])
    _write_text(json_path, json.dumps(_calibrated(cross_to_dict(result), cal), indent=1), force)
    _echo(f"timing: the searches took {result.wall_s:.1f} s of wall time on this machine (it varies by machine; "
          f"not part of the plan or the report)", err=True)
    if not result.rows:
        _echo("infeasible: no framework searched has a candidate that fits (each framework's line says why)",
              err=True)
    raise typer.Exit(0 if result.rows else 1)
