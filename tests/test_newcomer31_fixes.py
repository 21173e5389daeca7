"""Newcomer trial 31's leftovers (a Megatron-LM user planning Llama-3-70B at seq 131072 on 256 H100;
the job in tests/configs.py, :data:`~tests.configs.NC31_MEGATRON_SH` and :func:`~tests.configs.nc31_toml`)."""

from __future__ import annotations

import tomllib

from meshplan import catalog
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB
from tests.cli_run import run_cli
from tests.configs import NC31_MEGATRON_SH, nc31_toml


def _planned(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return build_plan(load_config(path))


def test_fix_line_offers_cp_from_pp_before_the_slower_full_recompute(tmp_path, capsys):
    # #1: pp 8 x dp 1 x cp 4 x tp 8 peaks at 100.5 GiB over the usable 79.11 GiB x 0.9 = 71.2 GiB. The line offered
    # only recompute full (54.0 s) while cp 8 from pp (pp 4 x cp 8 x tp 8, the constraint table's "cp >= 8") fits
    # at a shorter step. Each variant's step and peak here is its own config planned and stepped in the test; the
    # line must list both, ordered by those steps.
    job = tmp_path / "p2p_cp4.toml"
    job.write_text(nc31_toml())
    variants = {"cp 8 (pp 4 x cp 8 x tp 8)": _planned(tmp_path, "cp8.toml", nc31_toml((4, 1, 8, 8))),
                "recompute full": _planned(tmp_path, "full.toml", nc31_toml(recompute="full"))}
    assert all(p.feasible for p in variants.values())
    steps = {w: step_time(p).step_s for w, p in variants.items()}
    order = sorted(steps, key=steps.get)
    code, _, err = run_cli(["plan", job], capsys)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("fix: ")
    parts = line.removeprefix("fix: ").split("; ")
    listed = [next(w for w in variants if p.startswith(w + " -> ")) for p in parts if " -> " in p]
    assert listed == order
    for w, p in variants.items():
        assert f"{w} -> peak {p.timeline.peak.total_bytes / GiB:.1f} GiB (fits; step {steps[w]:.1f} s" in line


def _imported(tmp_path, capsys, *extra) -> tuple[dict, str]:
    """(the TOML ``meshplan import megatron`` writes of :data:`NC31_MEGATRON_SH` with ``--model llama3-70b``,
    its stderr notes)."""
    script, out = tmp_path / "train_70b.sh", tmp_path / "job.toml"
    script.write_text(NC31_MEGATRON_SH)
    code, out_text, err = run_cli(["import", "megatron", script, "--model", "llama3-70b", "--cluster", "dgx-h100",
                            "--nodes", "32", "-o", out, *extra], capsys)
    assert code == 0, err
    return tomllib.loads(out.read_text()), out_text + err


def test_import_keeps_the_scripts_max_position_embeddings(tmp_path, capsys):
    # #2: the script sets --max-position-embeddings 131072 (= its --seq-length); the catalog's llama3-70b has
    # max_position 8192 (Llama 3's context). The import replaced the script's value by 8192, then noted that
    # Megatron-LM asserts max_position_embeddings >= seq_length and asked to raise it: the script's own value is
    # kept beside the catalog model, and no such note.
    assert catalog.model("llama3-70b").max_position == 8192
    job, err = _imported(tmp_path, capsys)
    assert job["model"] == {"catalog": "llama3-70b", "max_position": 131072}
    assert "asserts max_position_embeddings" not in err
    replaced = next(line for line in err.splitlines() if "replaces the model flags" in line)
    assert "--max-position-embeddings" not in replaced and "--num-layers" in replaced
    # and the plan of it says nothing of a context longer than the model's
    plan = build_plan(load_config(tmp_path / "job.toml"))
    assert plan.config.model.max_position == 131072 == plan.config.training.seq_len


def test_distributed_optimizer_run_is_not_said_to_run_fsdp(tmp_path, capsys):
    # #3: sharding zero1 under framework megatron is Megatron-LM's distributed optimizer (--use-distributed-optimizer),
    # which shards the fp32 master weights and Adam moments over the data-parallel group with context parallel,
    # dp 1 x cp 4 = 4 ranks; no FSDP runs. The mesh derivation said "fsdp = dp 1 * cp 4 = 4"; it names the group as
    # the groups table does.
    job = tmp_path / "p2p_cp4.toml"
    job.write_text(nc31_toml())
    _, out, err = run_cli(["plan", job], capsys)
    lines = [line.strip() for line in (out + err).splitlines()]
    assert "dp x cp (distributed optimizer) = dp 1 * cp 4 = 4" in lines
    assert not [line for line in lines if line.startswith("fsdp")]
    assert build_plan(load_config(job)).derivation == ("dp x cp (distributed optimizer) = dp 1 * cp 4 = 4",
                                                       "loss = dp 1 * cp 4 = 4")


def _exported(tmp_path, capsys, job) -> list[str]:
    """The argument lines of ``meshplan export JOB --to megatron`` (its header comments left out)."""
    out = tmp_path / f"{job.stem}.sh"
    code, _, err = run_cli(["export", job, "--to", "megatron", "-o", out], capsys)
    assert code == 0, err
    return [line for line in out.read_text().splitlines() if line.startswith("--")]


def test_import_names_megatrons_dropout_defaults_and_export_writes_them_back(tmp_path, capsys):
    # #4: the script sets neither --attention-dropout nor --hidden-dropout, so Megatron-LM runs its TransformerConfig
    # defaults, 0.1 each (megatron_flags.DROPOUT), and the import plans dropout on ([memory] dropout = true): a note
    # now says so and names the flags a Llama-style run sets to turn it off.
    job, notes = _imported(tmp_path, capsys)
    assert job["memory"] == {"dropout": True}
    said = [line for line in notes.splitlines() if "dropout" in line]
    assert len(said) == 1
    assert "--hidden-dropout and --attention-dropout not given: Megatron-LM's default 0.1 each" in said[0]
    assert said[0].endswith("Llama-style runs set --attention-dropout 0 --hidden-dropout 0")
    # export writes no dropout flag: Megatron-LM's default 0.1 is the plan's dropout on
    assert not [a for a in _exported(tmp_path, capsys, tmp_path / "job.toml") if "dropout" in a]
    # with the flags the note names, no note, dropout off, and export writes them back as 0.0
    script = tmp_path / "train_70b.sh"
    script.write_text(NC31_MEGATRON_SH.replace("--recompute-activations", "--recompute-activations "
                                               "--attention-dropout 0 --hidden-dropout 0"))
    code, out_text, err = run_cli(["import", "megatron", script, "--model", "llama3-70b", "--cluster", "dgx-h100",
                                   "--nodes", "32", "-o", tmp_path / "off.toml"], capsys)
    assert code == 0 and "dropout" not in out_text + err
    assert "memory" not in tomllib.loads((tmp_path / "off.toml").read_text())  # dropout false, the default
    assert {"--hidden-dropout 0.0", "--attention-dropout 0.0"} <= set(_exported(tmp_path, capsys, tmp_path / "off.toml"))
