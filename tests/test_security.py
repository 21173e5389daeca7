"""Security (issue 13 item 1): input never becomes a command or a terminal escape.

- Generated launchers (``place --bindings F --format sh``) quote every value that comes from
  input and escape comments: the script is run with hostile node and NIC names under ``sh``
  with a stand-in ``numactl`` on PATH, and only the intended command runs, with the values
  intact.
- Names in specs are restricted to a safe character set; the error names the field and the
  character, on one printable line.
- Control characters and escape sequences that reach an error line or the CLI's output are
  escaped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from meshplan.catalog import system
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError, printable
from meshplan.placement.assign import place
from meshplan.placement.bindings import to_sh, write_bindings
from meshplan.placement.topology import parse_nccl_topo_xml
from meshplan.placement.topology_node import node_from_topology
from meshplan.spec.cluster import NICSpec
from meshplan.spec.names import check_name
from tests.cli_run import run_captured

ROOT = Path(__file__).resolve().parents[1]

HOSTILE = [
    "mlx5_0\ntouch PWNED_newline",
    "$(touch PWNED_subst)",
    "`touch PWNED_backtick`",
    "x'; touch PWNED_quote; echo '",
    'x"; touch PWNED_dquote; echo "',
    "x\r\ntouch PWNED_crlf",
    "x\x1b[2J\u202e; touch PWNED_escape",
]

FAKE_NUMACTL = """#!/bin/sh
# stands in for numactl: records its arguments and the bound variables, then runs nothing
printf '%s\\n' "numactl $*" >> "$LOG"
printf 'NCCL_IB_HCA=%s\\n' "$NCCL_IB_HCA" >> "$LOG"
printf 'CUDA_VISIBLE_DEVICES=%s\\n' "$CUDA_VISIBLE_DEVICES" >> "$LOG"
"""


def _hostile_placement(node_name: str, nic_names: list[str]):
    """A 1-node seed placement whose node and NICs carry ``node_name`` / ``nic_names``,
    built with ``model_copy`` (no validation), as if a reader had let them through."""
    cl = system("seed-8x8-2nic", 1)
    nics = [n.model_copy(update={"name": name}) for n, name in zip(cl.node.nics, nic_names)]
    node = cl.node.model_copy(update={"name": node_name, "nics": nics})
    return place(cl.model_copy(update={"node": node}), cl.node.gpus)


@pytest.mark.parametrize("evil", HOSTILE)
def test_generated_launcher_runs_only_the_intended_command(tmp_path, evil):
    p = _hostile_placement(f"node\n{evil}\n", [evil, "nic1\ntouch PWNED_second_nic"])
    script = write_bindings(tmp_path / "bind.sh", p, fmt="sh")
    assert os.access(script, os.X_OK)
    text = script.read_text()
    # every comment stays on its line (a newline in it would start a command): printable ASCII only
    comments = [ln[ln.index("#"):] for ln in text.split("\n") if ln.startswith("#") or ") # rank" in ln]
    # 4 header lines, "What each variable does:" with CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, NCCL_IB_HCA
    # and the NCCL_CROSS_NIC note (two rails, one tier: not set), as bind.sh (nccl_env.env_comments), 8 ranks
    assert len(comments) == 4 + 5 + 8 and all(" " <= ch <= "~" for c in comments for ch in c)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "numactl").write_text(FAKE_NUMACTL)
    (bindir / "numactl").chmod(0o755)
    log = tmp_path / "log.txt"
    for local in (0, 5):
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "GROUP_RANK": "0", "LOCAL_RANK": str(local), "LOG": str(log)}
        r = subprocess.run(["sh", str(script), "python", "train.py"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "" and r.stderr == ""
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bin", "bind.sh", "log.txt"]  # nothing PWNED_*
    # rank 0: GPU 0 on socket 0, its 56 cores / 4 GPUs = 14 cores 0-13, NIC 0; rank 5 NIC 1
    lines = log.read_text().split("\n")
    assert lines[0] == "numactl --physcpubind=0-13 --membind=0 python train.py"
    rank0_hca = log.read_bytes().decode().split("NCCL_IB_HCA=", 1)[1].split("\nCUDA_VISIBLE_DEVICES=0\n", 1)[0]
    # --nic-scope node (the default): both of the node's NICs, each value intact
    assert rank0_hca == "=" + ",".join(n if ":" in n else f"{n}:1" for n in (evil, "nic1\ntouch PWNED_second_nic"))
    assert "CUDA_VISIBLE_DEVICES=5\n" in log.read_text()
    assert log.read_text().count("numactl ") == 2


def test_launcher_comments_escape_control_characters():
    p = _hostile_placement("dgx\n\x1b[2Jrm -rf ~", ["a\nb", "nic1"])
    text = to_sh(p)
    assert "(dgx\\x0a\\x1b[2Jrm -rf ~)" in text and "NIC a\\x0ab" in text
    assert all(ch == "\n" or " " <= ch <= "~" for ch in text.replace("'a\nb:1'", ""))


@pytest.mark.parametrize("name,ok", [("mlx5_0", True), ("mlx5_0:1", True), ("enp1s0f0", True),
                                     ("meta-llama/Meta-Llama-3-8B", True), ("a" * 128, True),
                                     ("a" * 129, False), ("", False), ("-x", False), ("a b", True), ("a ", False), (" a", False),
                                     ("a\nb", False), ("a$b", False), ("a;b", False), ("a`b", False),
                                     ("a'b", False), ("a\x1bb", False), ("\u202eab", False)])
def test_name_charset(name, ok):
    if ok:
        assert check_name(name) == name
    else:
        with pytest.raises(ValueError):
            check_name(name)


def test_spec_refuses_hostile_nic_name():
    with pytest.raises(ValidationError, match="not allowed in a name"):
        NICSpec(name="mlx5_0\ntouch x", rate_gbit_per_s=400, gpus=[0], rail=0)


@pytest.mark.parametrize("table,key,value", [("model", "name", "llama\x1b[2J"), ("model", "name", "a\nb"),
                                             ("mesh", "names", ["dp_shard", "t\x1bp"])])
def test_config_name_errors_are_one_printable_line(table, key, value):
    data = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 1024}, "mesh": {"names": ["dp_shard", "tp"], "shape": [1, 8]}}
    data[table][key] = value
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    line = str(err.value)
    # refused at input (config's control-character check) or by the name type, each naming the field
    assert line.startswith(f"{table}.{key}") and ("not allowed in a name" in line or "control character" in line)
    assert line.isprintable() and "\n" not in line and "\x1b" not in line


def test_topology_with_hostile_nic_name_is_one_line_error():
    xml = """<system version="1"><cpu numaid="0" affinity="0000ffff">
      <pci busid="0000:0a:00.0" class="0x060400">
        <pci busid="0000:0c:00.0" class="0x030200"><gpu dev="0"/></pci>
        <pci busid="0000:0d:00.0" class="0x020700"><nic><net name="mlx5_0&#10;touch PWNED" dev="0" speed="200000"
         port="1"/></nic></pci>
      </pci></cpu></system>"""
    base = system("seed-8x8-2nic", 1).node.model_copy(update={"gpus": 1, "sockets": [{"gpus": [0], "cores": 8}]})
    with pytest.raises(ConfigError) as err:
        node_from_topology(parse_nccl_topo_xml(xml, source="t.xml"), base)
    assert err.value.field == "t.xml" and ("not allowed in a name" in str(err.value) or "not a printable name" in str(err.value))
    assert str(err.value).isprintable()


def test_printable_escapes_terminal_controls():
    assert printable("a\x1b[2Jb\x07\x9b\r\n\u2028\u202e") == "a\\x1b[2Jb\\x07\\x9b\\x0d\\x0a\\u2028\\u202e"
    assert printable("plain text: 1.5 GiB, tp 8 · dp 8") == "plain text: 1.5 GiB, tp 8 · dp 8"
    err = ConfigError("model.catalog", "unknown model 'x\x1b[2J\nerror: fake'")
    assert str(err) == "model.catalog: unknown model 'x\\x1b[2J\\x0aerror: fake'"


def test_cli_error_line_from_hostile_catalog_name(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\ncatalog = "llama\\u001b[2J\\nrm -rf"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                   '[training]\nglobal_batch = 8\nseq_len = 1024\n[mesh]\nnames = ["tp"]\nshape = [8]\n')
    r = run_captured("plan", str(cfg))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.catalog: ")
    # refused at input as a control character, or echoed escaped: never raw
    assert "\x1b" not in r.stderr and ("\\x1b[2J\\x0arm -rf" in lines[0] or "control character '\\x1b'" in lines[0])


def test_cli_output_path_with_control_characters_is_escaped(tmp_path):
    out = tmp_path / "p\x1b[2J.json"
    r = run_captured("place", str(ROOT / "examples" / "seed-64gpu.toml"), "--bindings", str(out))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "p\\x1b[2J.json" in r.stdout
    assert json.loads(out.read_text())[0]["rank"] == 0


def test_report_header_escapes_a_hostile_config_path(tmp_path):
    """The plan report's header echoes the config path: ESC and rich markup come out escaped."""
    cfg = tmp_path / "x\x1b[2J[red]y.toml"
    cfg.write_text((ROOT / "examples" / "seed-64gpu.toml").read_text())
    r = run_captured("plan", cfg.name, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "meshplan plan x\\x1b[2J[red]y.toml" in r.stdout.splitlines()[0]
