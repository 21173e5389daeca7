"""The foreign config a meshplan TOML was imported from (its ``[source]`` table), so that an export
of the TOML carries what an export of the foreign file carries (newcomer trial 17 #2).

``meshplan import auto job.sh -o job.toml`` writes ``[source] path = "job.sh"`` (relative to the
TOML's folder) and ``format = "megatron"``. ``meshplan export job.toml --to megatron`` (and
``search --export``) then reads job.sh again, as it would read it given directly
(:func:`meshplan.interop.export.user_source`): the flags meshplan does not plan (``--lr``,
``--train-iters``, ``--save`` ...) are carried unchanged, the header naming the file. Where the
file is gone or no longer reads, the export says so in one line, with the fix (restore it, or
export from the original file), instead of dropping its settings silently. The file is read as it
is now: a flag meshplan plans that it gives otherwise than the TOML is listed as written
otherwise, as for any user file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.fileread import note_input
from meshplan.interop.export import user_source
from meshplan.interop.export_formats import UserFile
from meshplan.interop.written_paths import written_path
from meshplan.spec.hf import hf_source


def source_table(source: Path, fmt: str, out: Path | None) -> dict[str, str]:
    """The ``[source]`` table of a TOML written to ``out`` (None: printed, the path then absolute)
    imported from ``source`` as ``fmt``: the path relative to ``out``'s folder.

    >>> source_table(Path("/jobs/gpt/run.sh"), "megatron", Path("/jobs/plans/run.toml"))
    {'path': '../gpt/run.sh', 'format': 'megatron'}
    """
    return {"path": written_path(source, out), "format": fmt}


def carried_source(config: Path, fmt: str | None, cfg: Config) -> tuple[UserFile | None, list[str]]:
    """(the user file an export of ``config`` carries, warning lines): ``config`` itself when it
    is a foreign config; else its ``[source]`` file (:attr:`Config.source <meshplan.config.Config>`),
    named ``FILE, the [source] of CONFIG`` in the header; a [source] that is gone or does not read
    is a line saying its settings are not carried and how to carry them."""
    user = user_source(config, fmt)
    if user is not None or cfg.source is None:
        return user, []
    path, source_fmt = cfg.source
    note_input(path, f"[source] of {Path(config).name}")
    why = "is gone" if not Path(path).is_file() else None
    if why is None:
        try:
            user = user_source(path, source_fmt)
        except ConfigError as e:
            why = f"no longer reads as {source_fmt} ({e})"
    if why is not None:
        return None, [f"{path}, the [source] of {config} (the {source_fmt} file it was imported from), {why}: its "
                      f"settings meshplan does not plan (listed in {config.name}'s header) are not carried; restore "
                      f"it, or export from the original file"]
    if user is None:  # a [source] naming a meshplan TOML: nothing foreign to carry
        return None, []
    return user._replace(name=f"{path}, the [source] of {config}"), []


def with_source_model(cfg: Config, user: UserFile | None) -> Config:
    """``cfg`` with the [model] keys of its ``[source]`` torchtitan job TOML ``user``
    (:attr:`~meshplan.config.Config.source_model`) where the model is the Hugging Face config that
    file's ``model.hf_assets_path`` names (relative to the file's folder, as its import read it), so
    that an export to torchtitan writes them back as an export of the file itself does; ``cfg``
    unchanged otherwise."""
    if cfg.source_model or user is None or user.fmt != "torchtitan" or cfg.source is None:
        return cfg
    model, hf = user.doc.get("model", {}), hf_source(cfg.model.source)
    folder = model.get("hf_assets_path") if isinstance(model, dict) else None
    if hf is None or not isinstance(folder, str):
        return cfg
    path = Path(folder) if Path(folder).is_absolute() else Path(cfg.source[0]).parent / folder
    if (path / "config.json").resolve() != Path(hf[1]).resolve():
        return cfg
    named = {"name": "llama3", "flavor": "debugmodel"} | model  # torchtitan's defaults
    return replace(cfg, source_model=tuple((k, str(named[k])) for k in ("name", "flavor", "hf_assets_path")))
