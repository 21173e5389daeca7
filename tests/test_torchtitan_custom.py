"""Newcomer trial 27: ``export --to torchtitan`` of a dense Llama-style model torchtitan ships no
flavor of (a 30B: hidden 7168, 60 layers, 56 heads, 8 KV heads, FFN 20480, vocab 128256) exited 2.
It now writes the job TOML with ``model.flavor`` = the model's name and, beside it, the ``.py``
registering that flavor in torchtitan v0.2.2's ``llama3_args`` with the model's exact sizes.

torchtitan's FFN width (``FeedForward.__init__``, torchtitan/models/llama3/model/model.py:332-336
at e347b1e, with ``hidden_dim = 4 * dim``): multiple_of x ceil(int(ffn_dim_multiplier x
int(2 x 4 x dim / 3)) / multiple_of); every expected size below is worked through it by hand.
"""

from __future__ import annotations

import ast
import math

import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.errors import ConfigError
from meshplan.interop.export import export
from meshplan.interop.torchtitan_custom import llama3_ffn, not_llama3, snippet_flavors, solve_ffn
from meshplan.interop.torchtitan_write import custom_flavor, model_table
from tests.cli_run import run_main
from tests.configs import job_toml

#: The newcomer's model (/tmp/nc27/fsdp_tp2.toml's [model]).
MODEL30 = {"name": "llama-30b-ish", "layers": 60, "hidden": 7168, "ffn": 20480, "q_heads": 56, "kv_heads": 8,
           "head_dim": 128, "vocab": 128256, "max_position": 8192, "rope_theta": 500000.0, "norm_eps": 1e-05}
TRAINING = {"global_batch": 512, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3", "recompute": "none"}
MESH = {"names": ["dp_shard", "tp"], "shape": [128, 2], "sequence_parallel": True}


def _cfg(model: dict):
    return config_from_dict({"model": model, "cluster": {"system": "dgx-a100", "nodes": 32}, "training": TRAINING,
                             "mesh": MESH})


def test_torchtitans_formula_gives_the_llama3_sizes():
    """The formula against Meta's published FFN sizes, with torchtitan's own args (e347b1e
    llama3/__init__.py:52-99): 8B dim 4096, 1.3, 1024 -> int(2 x 16384 / 3) = 10922, int(1.3 x 10922) =
    14198, 1024 x ceil(14198 / 1024) = 1024 x 14 = 14336; 70B dim 8192, 1.3, 4096 -> 21845, 28398,
    4096 x 7 = 28672; 405B dim 16384, 1.2, 4096 -> 43690, 52428, 4096 x 13 = 53248 (Llama 3 paper,
    Table 3: FFN 14,336 / 28,672 / 53,248)."""
    assert llama3_ffn(4096, 1024, 1.3) == 1024 * math.ceil(int(1.3 * int(2 * 16384 / 3)) / 1024) == 14336
    assert llama3_ffn(8192, 4096, 1.3) == 4096 * 7 == 28672
    assert llama3_ffn(16384, 4096, 1.2) == 4096 * 13 == 53248
    assert llama3_ffn(7168, 1024, 1.07) == 20480  # the newcomer's: int(1.07 x 19114) = 20451, 1024 x 20 = 20480


def test_the_30b_ffn_is_solved_exactly():
    """dim 7168: int(2 x 28672 / 3) = int(19114.67) = 19114. With no multiplier's decimals (1.0):
    int(1.0 x 19114) = 19114; 4096 x ceil(19114 / 4096) = 4096 x 5 = 20480, the model's FFN (4096: the
    largest multiple_of tried, torchtitan's largest; 2048 x 10 = 20480 would do too). FFN 20481 is odd: multiple_of 1,
    so int(x x 19114) = 20481 needs x in [20481 / 19114, 20482 / 19114) = [1.071518, 1.071570), which
    holds no 3-decimal number (1.071 and 1.072 bracket it): refused."""
    assert int(2 * (4 * 7168) / 3) == 19114
    assert solve_ffn(7168, 20480) == (4096, 1.0)
    assert llama3_ffn(7168, 4096, 1.0) == 4096 * 5 == 20480
    assert solve_ffn(7168, 20481) is None
    assert int(1.071 * 19114) == 20471 and int(1.072 * 19114) == 20490  # the bracketing 3-decimal values
    assert not_llama3(_cfg(MODEL30 | {"ffn": 20481}).model).startswith("ffn 20481: no multiple_of (a power of two up to 4096) and ffn_dim_multiplier")


def test_export_writes_the_toml_and_the_flavor_snippet(tmp_path, capsys):
    """The newcomer's command: exit 0, the job TOML naming the flavor, the .py of the same stem whose
    TransformerModelArgs (read with ast, never run) states each size, one line saying where it goes."""
    src = tmp_path / "fsdp_tp2.toml"
    src.write_text(job_toml(MODEL30, system="dgx-a100", nodes=32, training=TRAINING, mesh=MESH))
    out = tmp_path / "tt.toml"
    assert run_main("export", src, "--to", "torchtitan", "-o", out) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    assert '[model]\nname = "llama3"\nflavor = "llama-30b-ish"\n' in text
    assert "not expressed in torchtitan" not in text  # the round trip read the snippet back: the same model
    py = (tmp_path / "tt.py").read_text()
    tree = ast.parse(py)
    assign = next(n for n in tree.body if isinstance(n, ast.Assign))
    call = assign.value
    assert ast.unparse(assign.targets[0]) == "llama3_args['llama-30b-ish']"
    assert ast.unparse(call.func) == "TransformerModelArgs"
    args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert args == {"dim": 7168, "n_layers": 60, "n_heads": 56, "n_kv_heads": 8, "vocab_size": 128256,
                    "multiple_of": 4096, "ffn_dim_multiplier": 1.0, "norm_eps": 1e-05, "rope_theta": 500000.0,
                    "max_seq_len": 8192}
    assert "from torchtitan.models.llama3 import llama3_args\n" in py
    assert "int(2 x 4 x 7168 / 3) = 19114; int(1.0 x 19114) = 19114; 4096 x ceil(19114 / 4096) = 20480" in py
    line = [ln for ln in printed.splitlines() if ln.startswith(f"wrote {tmp_path / 'tt.py'}")]
    assert line == [f"wrote {tmp_path / 'tt.py'}: torchtitan llama3 flavor 'llama-30b-ish' (model.flavor of "
                    "tt.toml); run it before training: [experimental] custom_import = \"tt\" with its folder on "
                    "PYTHONPATH, or append it to torchtitan/models/llama3/__init__.py"]
    # read back beside the TOML: plan/import of tt.toml is the model itself
    back = snippet_flavors(py)["llama-30b-ish"]
    assert (back["hidden"], back["layers"], back["ffn"], back["q_heads"], back["kv_heads"], back["head_dim"],
            back["vocab"]) == (7168, 60, 20480, 56, 8, 7168 // 56, 128256)
    assert run_main("import", "torchtitan", out, "--cluster", "dgx-a100", "--nodes", "32", "-o", tmp_path / "m.toml") == 0
    m = load_config(tmp_path / "m.toml").model
    assert m.architecture() == _cfg(MODEL30).model.architecture()


def test_export_never_overwrites_the_snippet(tmp_path, capsys):
    """An existing .py of that stem is refused before anything is written (the TOML neither);
    stdout holds one file, so -o - is refused too."""
    src = tmp_path / "c.toml"
    src.write_text(job_toml(MODEL30, system="dgx-a100", nodes=32, training=TRAINING, mesh=MESH))
    (tmp_path / "tt.py").write_text("mine\n")
    assert run_main("export", src, "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 2
    assert f"-o: {tmp_path / 'tt.py'} exists; choose another path or pass --force" in capsys.readouterr().err
    assert (tmp_path / "tt.py").read_text() == "mine\n" and not (tmp_path / "tt.toml").exists()
    assert run_main("export", src, "--to", "torchtitan", "-o", "-") == 2
    assert "error: -o: - (stdout) holds one file; this export writes two" in capsys.readouterr().err


def test_force_replaces_only_a_flavor_file_meshplan_wrote(tmp_path, capsys):
    """``-o train.toml --force`` beside the user's own ``train.py`` (a training script): --force
    replaces -o, never a .py meshplan did not write (exit 2, both files as they were); the .py an
    earlier export wrote is replaced (exit 0)."""
    src = tmp_path / "c.toml"
    src.write_text(job_toml(MODEL30, system="dgx-a100", nodes=32, training=TRAINING, mesh=MESH))
    (tmp_path / "train.toml").write_text("old\n")
    (tmp_path / "train.py").write_text("import torch\n")
    assert run_main("export", src, "--to", "torchtitan", "-o", tmp_path / "train.toml", "--force") == 2
    assert (f"-o: {tmp_path / 'train.py'} exists and is no flavor file meshplan wrote (--force replaces only "
            "those)") in capsys.readouterr().err
    assert (tmp_path / "train.py").read_text() == "import torch\n" and (tmp_path / "train.toml").read_text() == "old\n"
    assert run_main("export", src, "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 0
    assert run_main("export", src, "--to", "torchtitan", "-o", tmp_path / "tt.toml", "--force") == 0
    assert (tmp_path / "tt.py").read_text().startswith("# meshplan export: torchtitan llama3 flavor 'llama-30b-ish'")


#: A small dense Llama-style model of no shipped flavor for a fast search: FFN by torchtitan's
#: formula, int(2 x 4 x 256 / 3) = 682, 256 x ceil(682 / 256) = 768 (multiple_of 256, multiplier 1.0).
TINY = {"name": "tiny-llama", "layers": 2, "hidden": 256, "ffn": 768, "q_heads": 4, "kv_heads": 2, "head_dim": 64,
        "vocab": 1024}


def test_search_export_refuses_the_snippet_before_the_search(tmp_path, capsys):
    """``search --export 1 --to torchtitan -o tt.toml`` of such a model writes tt.py too: an existing
    tt.py is refused before the search runs (as an existing -o is), not after the whole search, with
    nothing written; exit 2."""
    assert llama3_ffn(256, 256, 1.0) == 256 * math.ceil(682 / 256) == 768
    src = tmp_path / "tiny.toml"
    src.write_text(job_toml(TINY, training={"global_batch": 8, "seq_len": 512},
                            search={"pp": [1], "micro_batch": [1], "recompute": ["none"]}))
    (tmp_path / "tt.py").write_text("mine\n")
    assert run_main("search", src, "--export", "1", "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 2
    out, err = capsys.readouterr()
    assert f"-o: {tmp_path / 'tt.py'} exists; choose another path or pass --force" in err
    assert out == ""  # no search table: refused before the search
    assert (tmp_path / "tt.py").read_text() == "mine\n" and not (tmp_path / "tt.toml").exists()
    assert run_main("search", src, "--export", "1", "--to", "torchtitan", "-o", "-") == 2  # two files, one stdout
    out, err = capsys.readouterr()
    assert out == "" and "error: -o: - (stdout) holds one file; this export writes two" in err
    assert "candidates:" not in err  # the search's report (on stderr under -o -) never ran


@pytest.mark.parametrize("name, flavor", [("llama3-8b", "8B"), ("llama3-70b", "70B")])
def test_shipped_flavors_stay_shipped(name, flavor):
    """Llama 3 8B and 70B are torchtitan's own flavors: no snippet, the flavor named."""
    cfg = config_from_dict({"model": {"catalog": name}, "cluster": {"system": "dgx-h100", "nodes": 8},
                            "training": {"global_batch": 64, "seq_len": 8192}, "mesh": {"names": ["dp_shard"],
                                                                                       "shape": [64]}})
    assert custom_flavor(cfg) is None and model_table(cfg) == {"name": "llama3", "flavor": flavor}


@pytest.mark.parametrize("update, why", [
    ({"qkv_bias": True}, "qkv_bias: llama3 has no bias in its Linears (model.py:204-209 at e347b1e)"),
    ({"norm": "layernorm"}, "norm layernorm: llama3 normalises with nn.RMSNorm"),
    ({"tied_embeddings": True}, "tied_embeddings: llama3's output Linear is its own (model.py:458 at e347b1e)"),
    ({"head_dim": 64}, "head_dim 64: llama3's head size is dim // n_heads = 7168 // 56"),
])
def test_what_llama3_cannot_state_is_still_refused(update, why):
    """A model llama3's TransformerModelArgs cannot state keeps the refusal, with the reason."""
    cfg = _cfg(MODEL30 | update)
    assert custom_flavor(cfg) is None
    with pytest.raises(ConfigError) as e:
        export(cfg, "torchtitan", "x")
    assert "model 'llama-30b-ish' is none of them" in str(e.value)
    assert f"; nor can llama3's TransformerModelArgs state it: {why}; export --to megatron" in str(e.value)


def test_moe_keeps_its_refusal():
    """Mixtral (MoE) is no llama3 flavor: the refusal is the one before, without a llama3 remark."""
    cfg = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 64, "seq_len": 4096}, "mesh": {"names": ["dp_shard"],
                                                                                       "shape": [16]}})
    assert custom_flavor(cfg) is None
    with pytest.raises(ConfigError, match=r"model 'mixtral-8x7b' is none of them: nearest llama3 8B") as e:
        export(cfg, "torchtitan", "x")
    assert "TransformerModelArgs" not in str(e.value)


def test_a_shipped_flavors_name_is_not_taken():
    """A model named like a shipped flavor (8B) registers as meshplan-8B, never replacing torchtitan's."""
    cfg = _cfg(MODEL30 | {"name": "8B"})
    assert custom_flavor(cfg).name == "meshplan-8B" and model_table(cfg)["flavor"] == "meshplan-8B"


def test_snippet_reader_ignores_what_it_cannot_read():
    """A .py that is not a snippet (does not parse, or computes its args) gives no flavor."""
    assert snippet_flavors("def (") == {}
    assert snippet_flavors("llama3_args['x'] = TransformerModelArgs(dim=f())\n") == {}
    assert list(snippet_flavors("llama3_args['x'] = TransformerModelArgs(dim=64, n_layers=2, n_heads=4)\n")) == ["x"]


def test_a_flavor_no_model_has_names_its_file(tmp_path, capsys):
    """A hand-edited .py beside the job TOML registering sizes no model has: dim 64 over n_heads 128
    gives torchtitan's head size dim // n_heads = 64 // 128 = 0. One line naming model.flavor and
    that file (exit 2), not the [model] field ``model.head_dim`` the user never wrote."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "x"\n[training]\nseq_len = 512\nglobal_batch_size = 8\n'
                   'local_batch_size = 1\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    (tmp_path / "job.py").write_text("llama3_args['x'] = TransformerModelArgs(dim=64, n_layers=2, n_heads=128)\n")
    assert 64 // 128 == 0
    assert run_main("plan", job, "--cluster", "dgx-h100", "--nodes", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model.flavor: 'x', registered by {tmp_path / 'job.py'}, is "
                                               "no model meshplan plans (model.head_dim: must be greater than 0 (got 0)")
    assert err[0].endswith("fix its TransformerModelArgs there")
