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


def test_torchtitan_split_setting_by_hand():
    """torchtitan has no key of layer counts per stage (b5bcd76 config/configs.py:187-215): where its own
    cut gives the split, the counts it takes; else module names per model part. Llama-3-8B's 32 layers
    at pp 2 as [15, 17]: 32 + first + last slots in 2 parts of 17 need first + last = 2, part 0 holding
    17 - first = 15: first 2, last 0. Six layers as [1, 1, 4]: a middle part below the last is no cut of
    torchtitan's (the extra slots go to the first parts): names, the output Linear ``lm_head`` at b5bcd76.
    DeepSeek-V3's 61 at pp 8 x 2 chunks as [7, 8, 8, 8, 8, 8, 8, 6]: each stage's layers over its two
    chunks, the short one at the model's ends (stage 0: 3 + 4, stage 7: 3 + 3), parts in chunk x pp +
    stage order [3, 4 x 6, 3, 4 x 7, 3]; torchtitan cuts its short parts only at the ends: 16 name lists."""
    from meshplan.interop.torchtitan_split import parts_of, split_setting
    assert split_setting(32, [15, 17], 1, False) == ("parallelism.pipeline_parallel_first_stage_less_layers = 2, "
                                                     "parallelism.pipeline_parallel_last_stage_less_layers = 0")
    assert split_setting(6, [1, 1, 4], 1, True) == (
        'parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1"], '
        '["layers.2", "layers.3", "layers.4", "layers.5", "norm", "lm_head"]]')
    assert parts_of(61, [7, 8, 8, 8, 8, 8, 8, 6], 2) == [3] + [4] * 6 + [3] + [4] * 7 + [3]
    ds = split_setting(61, [7, 8, 8, 8, 8, 8, 8, 6], 2, False)
    assert ds.startswith('parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0", "layers.1", '
                         '"layers.2"], ["layers.3", ') and ds.count("], [") == 15
    assert '["layers.27", "layers.28", "layers.29"], ["layers.30"' in ds  # part 7: stage 7's first chunk of 3


#: Newcomer trial nc58's tt_ds32.toml: DeepSeek-V3 671B, pp 16 Interleaved1F1B (2 parts a rank), ep 64.
TT_DS32 = """[model]
name = "deepseek_v3"
flavor = "671B"
[training]
local_batch_size = 32
global_batch_size = 16384
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
pipeline_parallel_degree = 16
pipeline_parallel_schedule = "Interleaved1F1B"
expert_parallel_degree = 64
expert_parallel_comm_backend = "deepep"
[activation_checkpoint]
mode = "full"
"""


def test_bubble_hint_gives_torchtitan_module_names(tmp_path, capsys):
    """nc58 #3b: the bubble hint's pp 8 x dp_shard 256 mesh merges pp 16's split per stage in pairs,
    [7, 8, 8, 8, 8, 8, 8, 6] (torchtitan's default 16 parts [3, 4 x 14, 2] summed two by two); the trial
    saw it as ``module_fqns_per_model_part [7, 8, ...]``, counts where torchtitan takes names. Now the
    16 parts of test_torchtitan_split_setting_by_hand as module names (the output Linear ``output`` in a
    job TOML, torchtitan v0.2.2), the counts kept in words."""
    from meshplan.cli import main
    job = tmp_path / "tt_ds32.toml"
    job.write_text(TT_DS32)
    try:
        main(["step", str(job), "--cluster", "dgx-h100", "--nodes", "256"])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr()
    hint = next(x for x in (out.out + out.err).splitlines() if x.startswith("hint: the pipeline bubble"))
    assert "module_fqns_per_model_part [" not in hint and "mesh.pp_layer_split" not in hint
    assert ('pp 8 x dp_shard 256 (parallelism.pipeline_parallel_degree = 8, parallelism.data_parallel_shard_degree '
            '= 256, parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0", "layers.1", "layers.2"], '
            '["layers.3", ') in hint
    assert ('["layers.58", "layers.59", "layers.60", "norm", "output"]] (layers per stage [7, 8, 8, 8, 8, 8, 8, 6])'
            in hint)


def _mixtral_search_cfg():
    """Newcomer trial nc58's mx_ep1.toml (Mixtral-8x7B, Megatron-LM, 32 dgx-h100, zero1, no recompute)
    with a [search] held to pp 4 x dp 64 at tp 1, cp 1 and ep 1."""
    from meshplan.config import config_from_dict
    return config_from_dict({
        "model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 32},
        "training": {"global_batch": 1024, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                     "recompute": "none", "param_dtype": "bf16", "grad_reduce_dtype": "fp32",
                     "framework": "megatron", "moe_dropless": True},
        "search": {"pp": [4], "tp": [1], "ep": [1], "cp": [1], "recompute": ["none"], "sharding": ["zero1"],
                   "micro_batch": [1]}}, require_mesh=False)


def test_moe_search_with_no_fit_offers_more_ep():
    """nc58 #1b: at ep 1 every rank holds all 8 experts of its 8 layers (32 / pp 4): 8 x 8 x 3 x 4096 x
    14336 parameters, bf16 parameter + fp32 gradient 6 B each = 67,645,734,912 B = 63.0 GiB before the
    rest of the state and the activations, over the 71.2 GiB usable: no candidate fits. The no-fit fix
    names the widened ep row first (ep k keeps 8 / k experts a layer, 63.0 / k GiB of them), then the cp row
    as before; the ep row's peak is under usable memory and its mesh keeps pp 4 x dp 64 (ep re-factors dp)."""
    from meshplan.report.search_fix import infeasible_line
    from meshplan.search.driver import search
    from meshplan.search.widen import widen
    assert 8 * 8 * 3 * 4096 * 14336 * 6 == 67_645_734_912 and round(67_645_734_912 / GiB, 1) == 63.0
    r = widen(search(_mixtral_search_cfg(), workers=1), workers=1)
    assert not r.top and r.widened_ep is not None and r.widened is not None
    w = r.widened_ep
    assert w.axis == "ep" and w.degree in (2, 4, 8) and w.peak_bytes < 71.2 * GiB
    assert w.label.startswith(f"pp 4 x dp 64; experts efsdp {64 // w.degree} x ep {w.degree}")
    fix = infeasible_line(r).split("; fix: ", 1)[1]
    assert fix.startswith(f"widen [search] ep (now 1): with every ep the fastest that fits is {w.label} "
                          f"(ep {w.degree}: step ")
    assert "; or widen [search] cp (now 1): " in fix


def test_import_of_a_py_carries_its_source_to_the_export(tmp_path, capsys):
    """ttexport: ``import`` of a b5bcd76 registry's llama3_8b writes [source] with the path, the format and
    the function read (``config``), so that ``export --to torchtitan -o FILE.py`` of the TOML keeps what the
    .py states and meshplan does not plan, as an export of the .py itself does: the trial file's
    hf_assets_path "./assets/hf/Llama-3.1-8B", 1000 steps, default_adamw(lr=3e-4) and the checkpoint
    (enable, interval 500), none of them torchtitan's defaults ("./tests/assets/tokenizer", 10000, 8e-4).
    With the .py gone, a warning says nothing of it is carried (the defaults then noted)."""
    import tomllib

    from tests.cli_run import run_cli
    reg = _registry(tmp_path)
    toml = tmp_path / "j8.toml"
    assert run_cli(["import", "auto", reg, "--config", "llama3_8b", "--cluster", "dgx-h100", "--nodes", "1",
                    "-o", toml], capsys)[0] == 0
    assert tomllib.loads(toml.read_text())["source"] == {"path": "llama3/config_registry.py", "format": "torchtitan",
                                                        "config": "llama3_8b"}
    out = tmp_path / "e8.py"
    code, stdout, stderr = run_cli(["export", toml, "--to", "torchtitan", "-o", out], capsys)
    text = out.read_text()
    assert code == 0 and "def llama3_8b() -> Trainer.Config:" in text
    assert 'hf_assets_path="./assets/hf/Llama-3.1-8B"' in text and "steps=1000," in text
    assert "default_adamw(lr=0.0003)" in text and "interval=500" in text and 3e-4 == 0.0003
    assert (f"carried unchanged from {reg}, the [source] of {toml}: optimizer, training.steps, checkpoint.enable, "
            f"checkpoint.interval, hf_assets_path") in stdout + stderr
    reg.unlink()
    code, stdout, stderr = run_cli(["export", toml, "--to", "torchtitan", "-o", tmp_path / "gone.py"], capsys)
    assert code == 0 and f"{reg}, the [source] of {toml} (the torchtitan file it was imported from), is gone" in \
        stdout + stderr
    assert "steps=1000" not in (tmp_path / "gone.py").read_text()


def test_source_config_is_a_torchtitan_function_name():
    """[source] config names a function of a torchtitan .py: a Megatron-LM source has none (its own error
    naming source.config), nor is ``llama3-8b`` a Python name; the key read back as Config.source_config."""
    import pytest

    from meshplan.config import config_from_dict
    from meshplan.errors import ConfigError
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 64, "seq_len": 4096}, "mesh": {"names": ["dp_shard"], "shape": [-1]}}
    cfg = config_from_dict(base | {"source": {"path": "r.py", "format": "torchtitan", "config": "llama3_8b"}})
    assert cfg.source_config == "llama3_8b"
    for bad in ({"format": "megatron", "config": "llama3_8b"}, {"format": "torchtitan", "config": "llama3-8b"}):
        with pytest.raises(ConfigError, match="source.config"):
            config_from_dict(base | {"source": {"path": "r.py"} | bad})
