"""Import errors from newcomer trial nc52 (finding 16, 18): a DeepSpeed key misspelt near a
long field is pointed to that field, bf16.enabled "auto" is filled from --dtype as the HF Trainer
fills it from --bf16, and --cluster takes a TOML file with an inline [cluster]."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52c"
BASE = ["--model", "llama3-70b", "--seq-len", "4096", "--micro-batch", "1", "--grad-accum", "16"]


def test_misspelt_max_live_parameters_is_pointed_to_it(tmp_path, capsys):
    """typo.json (the trial's bad/typo.json) has zero_optimization.stage3_max_live_paramaters: one
    edit (e -> a) from DeepSpeedZeroConfig's stage3_max_live_parameters; "stage" only begins it
    (19 edits). Before: "did you mean zero_optimization.stage?"."""
    rc, _, err = run_cli(["import", "deepspeed", DATA / "typo.json", "--cluster", "dgx-h100", "--nodes", "4", *BASE,
                          "-o", tmp_path / "x.toml"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: zero_optimization.stage3_max_live_paramaters: not a field of DeepSpeed's "
                          "DeepSpeedZeroConfig, which refuses other keys; did you mean "
                          "zero_optimization.stage3_max_live_parameters?")


def test_bf16_auto_is_filled_from_dtype(tmp_path, capsys):
    """ds_z3_hf.json says bf16.enabled "auto", which the HF Trainer fills from --bf16
    (transformers integrations/deepspeed.py fill_match("bf16.enabled", args.bf16 or
    args.bf16_full_eval)). Without --dtype: a one-line error that names --dtype; with --dtype bf16
    the model is bf16 (training.param_dtype = "bf16"); --dtype fp32 (neither flag) plans fp32."""
    cmd = ["import", "deepspeed", DATA / "ds_z3_hf.json", "--cluster", "dgx-h100", "--nodes", "4", *BASE]
    rc, _, err = run_cli([*cmd, "-o", tmp_path / "a.toml"], capsys)
    assert rc == 2 and "bf16.enabled: \"auto\" is filled by the HF Trainer from its --bf16 flag" in err
    assert "pass --dtype bf16" in err
    for dtype in ("bf16", "fp32"):
        rc, _, err = run_cli([*cmd, "--dtype", dtype, "-o", tmp_path / f"{dtype}.toml"], capsys)
        assert rc == 0, err
        assert tomllib.loads((tmp_path / f"{dtype}.toml").read_text())["training"]["param_dtype"] == dtype


def test_cluster_option_takes_a_toml_file(tmp_path, capsys):
    """cluster_a100_4nic.toml (the trial's file: the docs' 4-NIC A100 40GB node written inline,
    4 nodes). Before: "--cluster: unknown node". Now its [cluster] is read whole: 4 nodes of 8
    A100 40GB with the 4 NICs mlx5_0..3 (world 32); --nodes 2 replaces its nodes. A node name the
    catalog does not hold is still refused, pointing to the file route."""
    out = tmp_path / "c.toml"
    rc, _, err = run_cli(["import", "deepspeed", DATA / "ds_z3.json", "--cluster", DATA / "cluster_a100_4nic.toml",
                          *BASE, "-o", out], capsys)
    assert rc == 0, err
    c = tomllib.loads(out.read_text())["cluster"]
    assert c["nodes"] == 4 and c["gpu"]["name"] == "a100-sxm-40gb"
    assert [n["name"] for n in c["node"]["nics"]] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    rc, _, err = run_cli(["import", "deepspeed", DATA / "ds_z3.json", "--cluster", DATA / "cluster_a100_4nic.toml",
                          "--nodes", "2", *BASE, "-o", tmp_path / "d.toml"], capsys)
    assert rc == 0 and tomllib.loads((tmp_path / "d.toml").read_text())["cluster"]["nodes"] == 2
    rc, _, err = run_cli(["import", "deepspeed", DATA / "ds_z3.json", "--cluster", "a100-40g-4nic", "--nodes", "4",
                          *BASE, "-o", tmp_path / "e.toml"], capsys)
    assert rc == 2 and "unknown node 'a100-40g-4nic'" in err
    assert "or give a TOML file whose [cluster] writes the node inline (--cluster node.toml)" in err
