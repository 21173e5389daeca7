"""The foreign-config options, in one place: ``--format --cluster --nodes --gpu --model --seq-len
--micro-batch --grad-accum --dtype --gradient-checkpointing --config``, what a torchtitan job TOML, Megatron-LM arguments or a DeepSpeed
JSON does not say (``--config``: which function of a torchtitan ``config_registry.py``). A command that reads foreign configs (plan, report, groups, memory, step,
reliability, search, export; import without ``--format``, its FORMAT being an argument) takes
one parameter ``foreign: Foreign`` and is decorated with :func:`foreign_options`, which puts the
eleven options at the end of its ``--help`` and hands them to it as one :class:`Foreign`.

Example: ``meshplan plan ds.json --cluster dgx-h100 --nodes 2 --model llama3-8b --seq-len 4096``
calls ``plan(config=Path("ds.json"), ..., foreign=Foreign(None, {"cluster": "dgx-h100", "nodes": 2,
"gpu": None, "model": "llama3-8b", "seq_len": 4096, "micro_batch": None, "grad_accum": None, "dtype": None,
"gradient_checkpointing": None, "job_config": None}))``,
and ``foreign.options()`` is the :class:`~meshplan.interop.common.ImportOptions` the loader
takes. The parameter names of :data:`OPTIONS` but ``fmt`` are ImportOptions' fields.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from meshplan.config_tables import read_cluster
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.interop.common import FORMATS, ImportOptions
from meshplan.spec.cluster import ClusterSpec

FORMAT_HELP = ("format of CONFIG: " + ", ".join(FORMATS) + " (default: detected; a torchtitan job TOML, Megatron-LM "
               "arguments or a DeepSpeed JSON is read directly)")
CLUSTER_HELP = ("foreign configs: catalog node of the cluster (e.g. dgx-h100), which they do not say, or a TOML "
                "file whose [cluster] table writes the node inline (its nodes unless --nodes is given)")
NODES_HELP = "foreign configs: number of nodes (default: a launch script's --nnodes)"
GPU_HELP = "foreign configs: catalog GPU replacing the node's"
MODEL_HELP = "foreign configs: catalog model or HF config.json (DeepSpeed needs it; replaces the file's model)"
SEQ_HELP = "foreign configs: tokens per sequence (DeepSpeed needs it)"
MICRO_BATCH_HELP = ("a DeepSpeed JSON's \"auto\" train_micro_batch_size_per_gpu: the HF Trainer's "
                    "--per_device_train_batch_size")
DTYPE_HELP = ("a DeepSpeed JSON's \"auto\" bf16.enabled / fp16.enabled: bf16 for the HF Trainer's --bf16, fp16 for "
              "--fp16, fp32 for neither")
GC_HELP = ("a DeepSpeed JSON run by the HF Trainer: its --gradient_checkpointing (every decoder layer "
           "checkpointed, recompute full; no DeepSpeed key says it)")
CONFIG_HELP = ("a torchtitan config_registry.py: the function to read, as torchtitan's --config (default: the "
               "file's only one); read without running it")
GRAD_ACCUM_HELP = ("a DeepSpeed JSON's \"auto\" gradient_accumulation_steps: the HF Trainer's "
                   "--gradient_accumulation_steps")

#: Each option as (parameter name, typer annotation), in the order ``--help`` lists them.
OPTIONS = (
    ("fmt", Annotated[Optional[str], typer.Option("--format", help=FORMAT_HELP)]),
    ("cluster", Annotated[Optional[str], typer.Option("--cluster", help=CLUSTER_HELP)]),
    ("nodes", Annotated[Optional[int], typer.Option("--nodes", help=NODES_HELP)]),
    ("gpu", Annotated[Optional[str], typer.Option("--gpu", help=GPU_HELP)]),
    ("model", Annotated[Optional[str], typer.Option("--model", help=MODEL_HELP)]),
    ("seq_len", Annotated[Optional[int], typer.Option("--seq-len", help=SEQ_HELP)]),
    ("micro_batch", Annotated[Optional[int], typer.Option("--micro-batch", help=MICRO_BATCH_HELP)]),
    ("grad_accum", Annotated[Optional[int], typer.Option("--grad-accum", help=GRAD_ACCUM_HELP)]),
    ("dtype", Annotated[Optional[str], typer.Option("--dtype", help=DTYPE_HELP)]),
    ("gradient_checkpointing", Annotated[Optional[bool], typer.Option("--gradient-checkpointing", help=GC_HELP)]),
    ("job_config", Annotated[Optional[str], typer.Option("--config", help=CONFIG_HELP)]),
)


@dataclass(frozen=True)
class Foreign:
    """The foreign-config options as given on the command line: ``fmt`` is ``--format`` (None:
    detected), ``given`` the others by :class:`ImportOptions` field name (None: not given).
    They are checked only when :meth:`options` builds the ImportOptions, where each command
    loads its config, so an output refused before the work is still refused first."""

    fmt: Optional[str] = None
    given: dict = field(default_factory=dict)

    def options(self) -> ImportOptions:
        """What the loader takes (:func:`meshplan.interop.foreign.load_any`); a ConfigError
        naming the option when a number is not a whole number >= 1. A ``--cluster`` ending in
        ``.toml`` is a file whose ``[cluster]`` table is read as a config's (:func:`cluster_file`)."""
        given = dict(self.given)
        if isinstance(given.get("cluster"), str) and given["cluster"].endswith(".toml"):
            given["cluster"] = cluster_file(Path(given["cluster"]), given.get("nodes"))
        return ImportOptions(**given)


def cluster_file(path: Path, nodes: Optional[int]) -> ClusterSpec:
    """The ``[cluster]`` table of TOML file ``path`` (a node written inline, e.g. docs/input.md's
    4-NIC A100 node; newcomer trial nc52 was told ``unknown node`` for such a file), read as a
    config's (:func:`meshplan.config_tables.read_cluster`), ``nodes`` (``--nodes``) replacing its
    own. A ConfigError naming ``--cluster`` when the file is missing or holds no [cluster]."""
    if not path.is_file():
        raise ConfigError("--cluster", f"{path}: no such file; give a catalog node or a TOML file with a [cluster] table")
    t = parse_toml(path.read_text(), str(path), "--cluster").get("cluster")
    if not isinstance(t, dict):
        raise ConfigError("--cluster", f"{path} holds no [cluster] table; write the node there as a config's [cluster]")
    return read_cluster(t | ({"nodes": nodes} if nodes is not None else {}))


def foreign_options(*, with_format: bool = True) -> Callable[[Callable], Callable]:
    """Decorator: the command's ``foreign`` parameter becomes the options of :data:`OPTIONS`
    (without ``--format`` when ``with_format`` is false), last in its signature as typer reads
    it; called, the command gets them as one ``foreign=Foreign(...)``."""
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ann)
             for name, ann in OPTIONS if with_format or name != "fmt"]

    def decorate(command: Callable) -> Callable:
        sig = inspect.signature(command, eval_str=True)
        kept = [p for name, p in sig.parameters.items() if name != "foreign"]

        @functools.wraps(command)
        def run(*args, **kwargs):
            fmt = kwargs.pop("fmt", None) if with_format else None
            given = {p.name: kwargs.pop(p.name, None) for p in added if p.name != "fmt"}
            return command(*args, foreign=Foreign(fmt, given), **kwargs)

        # what typer reads (inspect.signature stops at __signature__; get_type_hints reads __annotations__)
        setattr(run, "__signature__", sig.replace(parameters=kept + added))
        run.__annotations__ = {p.name: p.annotation for p in kept + added}
        return run
    return decorate
