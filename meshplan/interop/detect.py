"""The format of a config file, and its text read through the one bounded reader.

Detection (:func:`detect`): a ``.py`` file (or text importing torchtitan: :func:`is_python_job`)
is a torchtitan config registry; ``.json`` with DeepSpeed's batch or ``zero_optimization`` keys is
DeepSpeed; a TOML with torchtitan's tables (``[parallelism]``, ``[job]``,
``[activation_checkpoint]``) or keys (``model.flavor``, ``training.local_batch_size``) is
torchtitan, any other TOML meshplan; other text with Megatron-LM's flags
(``--num-layers``, ``--tensor-model-parallel-size``, ``--micro-batch-size``...) is Megatron-LM
arguments. Otherwise the caller gives ``--format``.

>>> from pathlib import Path
>>> detect(Path("job.toml"), "[parallelism]"), detect(Path("plan.toml"), "[model]")
('torchtitan', 'meshplan')
>>> detect(Path("a.args"), "--num-layers 32")
'megatron'
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json, read_text_limited
from meshplan.interop.common import FORMATS
from meshplan.limits import FILE_BYTES
from meshplan.spec.hf import not_a_job

#: torchtitan job TOML tables, any of which makes a TOML torchtitan's.
TORCHTITAN_TABLES = {"parallelism", "job", "activation_checkpoint", "optimizer", "lr_scheduler", "checkpoint",
                     "metrics", "profiling", "compile", "quantize"}
#: Megatron-LM flags, any of which makes other text Megatron-LM arguments.
MEGATRON_HINT = re.compile(r"--(num-layers|tensor-model-parallel-size|pipeline-model-parallel-size|micro-batch-size|"
                           r"hidden-size|global-batch-size)\b")


#: What marks a torchtitan Python job config (:func:`is_python_job`).
PYTHON_JOB = re.compile(r"^\s*(from|import)\s+torchtitan\b|\b(JobConfig|Trainer\.Config)\(", re.M)


def is_python_job(path: Path, text: str) -> bool:
    """Whether the file is a torchtitan Python job config: a ``.py`` file, or text not named
    ``.toml`` or ``.json`` importing torchtitan or building ``JobConfig(...)`` /
    ``Trainer.Config(...)``. torchtitan 9810191 (#2386, 2026-02-23, "Config System Refactor: TOML
    to Python Dataclass Registry") replaced the TOML job files with a ``config_registry.py`` per
    model, run with ``--module``/``--config``; meshplan reads its functions without running them
    (:mod:`meshplan.interop.torchtitan_pyjob`).

    >>> is_python_job(Path("config_registry.py"), "x = 1"), is_python_job(Path("job.toml"), "[job]")
    (True, False)
    """
    return path.suffix == ".py" or (path.suffix not in (".toml", ".json") and bool(PYTHON_JOB.search(text)))


#: The top-level keys of torchtitan's config dump (``Trainer.Config.to_dict``, b5bcd76 trainer.py:201-238,
#: written by ``debug.save_config_file`` and logged by ``debug.print_config``), any two marking one.
DUMP_KEYS = {"model_spec", "parallelism", "activation_checkpoint", "hf_assets_path", "dump_folder"}


def dump_refusal(path: Path, d: object) -> ConfigError | None:
    """The one-line error for torchtitan's JSON dump of a resolved job config (:data:`DUMP_KEYS`),
    which meshplan does not read: its ``activation_checkpoint`` no longer names its class
    (SelectiveAC or FullAC) and its float8 converters are folded into the model's layers; None for
    other JSON.

    >>> print(dump_refusal(Path("cfg.json"), {"model_spec": {}, "parallelism": {}}))  # doctest: +ELLIPSIS
    config: cfg.json: torchtitan's dump of a resolved job config (debug.save_config_file) is not read: ...
    """
    if not isinstance(d, dict) or len(DUMP_KEYS & set(d)) < 2:
        return None
    return ConfigError("config", f"{path}: torchtitan's dump of a resolved job config (debug.save_config_file) is not "
                       f"read: it drops the activation checkpoint's class and the converters; import the "
                       f"config_registry.py it came from, meshplan import torchtitan config_registry.py --config NAME")


def detect(path: Path, text: str) -> str:
    """The format of a config file (module docstring); ConfigError asking for --format, or
    :func:`dump_refusal`'s for torchtitan's JSON dump of a config."""
    if is_python_job(path, text):
        return "torchtitan"
    if path.suffix == ".json":
        d = parse_json(text, "config", str(path), "give a DeepSpeed JSON config", unique_keys=True, hjson=True)
        if isinstance(d, dict) and ({"train_batch_size", "train_micro_batch_size_per_gpu",
                                     "zero_optimization"} & set(d)):
            return "deepspeed"
        raise not_a_job(path, d) or dump_refusal(path, d) or ConfigError("--format", f"{path}: a JSON file without DeepSpeed's keys "
                                                f"(train_batch_size, zero_optimization); pass --format")
    if path.suffix == ".toml":
        try:
            d = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError, ValueError):
            return "meshplan"  # the meshplan reader says what is wrong, in its one line
        table = lambda key: d[key] if isinstance(d.get(key), dict) else {}
        if TORCHTITAN_TABLES & set(d) or "flavor" in table("model") or "local_batch_size" in table("training"):
            return "torchtitan"
        return "meshplan"
    if MEGATRON_HINT.search(text):
        return "megatron"
    raise sbatch_refusal(path, text) or ConfigError("--format", f"{path}: cannot tell the format; pass --format "
                                                    f"{' or '.join(FORMATS)}")


#: An ``srun`` command line of a Slurm batch script and the script or program it runs (its last
#: word ending ``.sh``, else its first word that is no option).
_SRUN = re.compile(r"^\s*srun\b(?P<rest>.*)$", re.M)


def sbatch_refusal(path: Path, text: str) -> ConfigError | None:
    r"""For a Slurm batch script (``#SBATCH`` lines or an ``srun`` line) without Megatron-LM's
    flags: the one-line error naming the script its ``srun`` runs, which holds the training
    flags, to import instead (newcomer trial 49: ``import auto x.sbatch`` only asked for
    ``--format``); None for other text.

    >>> print(sbatch_refusal(Path("j.sbatch"), "#SBATCH --nodes=2\nsrun --kill-on-bad-exit=1 bash train.sh"))
    config: j.sbatch: a Slurm batch script without Megatron-LM's flags: import the script its srun runs, meshplan import auto train.sh (its torchrun and pretrain_gpt.py flags)
    >>> sbatch_refusal(Path("x.txt"), "hello") is None
    True
    """
    srun = _SRUN.search(text)
    if srun is None and "#SBATCH" not in text:
        return None
    words = srun.group("rest").split() if srun else []
    scripts = [w for w in words if w.endswith((".sh", ".bash"))]
    runs = scripts[-1] if scripts else next((w for w in words if not w.startswith("-")), "")
    what = (f"import the script its srun runs, meshplan import auto {runs}" if runs else
            "import the launch script its srun runs, meshplan import auto SCRIPT")
    return ConfigError("config", f"{path}: a Slurm batch script without Megatron-LM's flags: {what} (its torchrun "
                       f"and pretrain_gpt.py flags)")


def meshplan_refusal(path: Path, text: str) -> ConfigError:
    """``import``'s error for a ``.toml`` :func:`detect` calls meshplan's: its TOML error first, the
    one line ``import torchtitan`` and ``plan`` give (:func:`~meshplan.config_toml.parse_toml`), an
    empty file (or one of comments only) said to be empty, else that it is already a meshplan TOML
    (newcomer trial nc55 #1: a torchtitan file with ``seq_len = = 8192``, and an empty one, were
    called "already a meshplan TOML", naming ``--format``).

    >>> print(meshplan_refusal(Path("job.toml"), "# nothing"))
    config: job.toml is empty (no table, no key): give the torchtitan job TOML, Megatron-LM arguments or DeepSpeed JSON to import
    >>> print(meshplan_refusal(Path("plan.toml"), "[model]"))
    --format: plan.toml is already a meshplan TOML
    """
    if not parse_toml(text, str(path)):
        return ConfigError("config", f"{path} is empty (no table, no key): give the torchtitan job TOML, Megatron-LM "
                           f"arguments or DeepSpeed JSON to import")
    return ConfigError("--format", f"{path} is already a meshplan TOML")


def config_text(path: Path) -> str:
    """The file as text through the one bounded reader (regular files only, the config size
    limit, UTF-8): the same one-line errors as a meshplan TOML's."""
    return read_text_limited(path, "config", FILE_BYTES["config"], "give the path of a config file")
