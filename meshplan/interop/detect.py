"""The format of a config file, and its text read through the one bounded reader.

Detection (:func:`detect`): ``.json`` with DeepSpeed's batch or ``zero_optimization`` keys is
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


def detect(path: Path, text: str) -> str:
    """The format of a config file (module docstring); ConfigError asking for --format."""
    if path.suffix == ".json":
        d = parse_json(text, "config", str(path), "give a DeepSpeed JSON config", unique_keys=True, hjson=True)
        if isinstance(d, dict) and ({"train_batch_size", "train_micro_batch_size_per_gpu",
                                     "zero_optimization"} & set(d)):
            return "deepspeed"
        raise not_a_job(path, d) or ConfigError("--format", f"{path}: a JSON file without DeepSpeed's keys "
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
    raise ConfigError("--format", f"{path}: cannot tell the format; pass --format {' or '.join(FORMATS)}")


def config_text(path: Path) -> str:
    """The file as text through the one bounded reader (regular files only, the config size
    limit, UTF-8): the same one-line errors as a meshplan TOML's."""
    return read_text_limited(path, "config", FILE_BYTES["config"], "give the path of a config file")
