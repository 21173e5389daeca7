"""Four findings left from newcomer trials nc57 and nc58 and the ttexport check (branch nclose): the
memory ``fix:`` line of a b5bcd76 torchtitan registry in its token keys (nc57 #4b); torchtitan's
pipeline split as lists of module names (nc58 #3b); the search's no-fit fix offering more ep
(nc58 #1b); the [source] of a job TOML imported from a torchtitan ``.py`` (ttexport).

tests/data/nc57b/llama3/config_registry.py.txt is newcomer trial 57's b5bcd76-named registry
(``num_tokens_per_microbatch_per_dp_rank``, ``max_context_length`` 8192, ``num_tokens_per_train_step``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.interop.foreign import ImportOptions, load_any
from meshplan.interop.keymaps import keymap_of
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.units import GiB

DATA = Path(__file__).parent / "data" / "nc57b"
NEW = DATA / "llama3" / "config_registry.py.txt"


def _registry(tmp_path: Path, old: str = "", new: str = "") -> Path:
    """The trial's registry under ``llama3/`` (the folder names the model), ``old`` replaced by ``new``."""
    folder = tmp_path / "llama3"
    folder.mkdir(exist_ok=True)
    text = NEW.read_text()
    assert old in text
    path = folder / "config_registry.py"
    path.write_text(text.replace(old, new))
    return path


def _plan_8b(path: Path):
    return build_plan(load_any(path, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1, job_config="llama3_8b")))


def test_b5bcd76_memory_fix_names_the_token_keys(tmp_path):
    """llama3_8b at tp 2 on one dgx-h100 (dp 4) with 8 x 8192 tokens a micro-batch per dp rank: 8
    sequences of max_context_length 8192, over memory. The fix halves the micro-batch, 4 sequences,
    which the file writes as num_tokens_per_microbatch_per_dp_rank 4 x 8192 = 32768 (not
    training.local_batch_size 4, a key b5bcd76 does not have); the same file edited to 4 * 8192 plans
    the peak the fix names."""
    over = _plan_8b(_registry(tmp_path, "num_tokens_per_microbatch_per_dp_rank=2 * 8192",
                              "num_tokens_per_microbatch_per_dp_rank=8 * 8192"))
    assert not over.feasible and over.config.training.micro_batch == 8
    line = memory_fix(over, keymap_of(over.config))
    assert "training.num_tokens_per_microbatch_per_dp_rank 32768 (4 x 8192) -> peak " in line
    assert "local_batch_size" not in line and "global_batch_size" not in line and 4 * 8192 == 32768
    edited = _plan_8b(_registry(tmp_path, "num_tokens_per_microbatch_per_dp_rank=2 * 8192",
                                "num_tokens_per_microbatch_per_dp_rank=4 * 8192"))
    peak = f"{edited.timeline.verdict_bytes / GiB:.1f} GiB"
    assert edited.feasible and f"(4 x 8192) -> peak {peak} (fits" in line


def test_b5bcd76_keymap_counts_the_global_batch_in_tokens(tmp_path):
    """The nodes part of a fix names the global batch (``... caps dp at``): 128 sequences of 8192
    tokens = 1048576 = num_tokens_per_train_step; a job TOML (planned as 238fa99) keeps its sequence keys."""
    keys = keymap_of(_plan_8b(_registry(tmp_path)).config)
    assert keys.amount("global_batch", 128) == "training.num_tokens_per_train_step 1048576 (128 x 8192)"
    assert keys.field("training.seq_len") == "training.max_context_length" and 128 * 8192 == 1048576
    cfg = _plan_8b(_registry(tmp_path)).config
    job = replace(cfg, training=cfg.training.model_copy(update={"op_sac_policy": "238fa99"}))  # a job TOML's
    assert keymap_of(job).amount("global_batch", 128) == "training.global_batch_size 128"
