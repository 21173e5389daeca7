"""Standing fuzz run of every reader (issue 13 item 6): mutated inputs through the CLI, each case
in its own forked subprocess under memory and CPU limits, outcomes counted by class.

    python benchmarks/fuzz.py [--configs 10000] [--others 2000] [--seed 0] [--show 3] [--jobs 1]
                              [--cpu-s 30] [--wall-s 120] [--mem-mb 2048]

The listed failures of issue 13 run first, then the random cases (the other readers'
interleaved with the configs'). Counts by class are printed every 500 cases; Ctrl-C (or
SIGTERM) stops the run and prints the counts of the cases run so far.

Families: configs (TOML input mutated as a dict and as text: wrong types, missing and unknown
keys and tables, huge and tiny numbers, NaN and infinity, byte flips, truncation, UTF-16 and
other non-UTF-8 bytes, control characters, deep nesting, long strings; ``hf_config`` set to
special files), run through plan, groups, step, place, reliability, nccl-check and search; and
the other readers: topology text and XML (``plan --topology``), calibration (``plan
--calibration``), NCCL logs (``nccl-check``), nccl-tests output (``calibrate``), GEMM and
attention tables (``step --gemm-table``) and Hugging Face config.json (``hf_config``).

A case is good when it exits 0 or 1 (a result), or 2 with exactly one line ``error: ...`` on
stderr. Classes counted otherwise:

- ``traceback``: a Python traceback, or an exit status other than 0, 1, 2;
- ``hang``: over the CPU limit (``--cpu-s``, RLIMIT_CPU) or the wall limit (``--wall-s``);
- ``memory``: MemoryError or killed under the address-space limit (``--mem-mb``, RLIMIT_AS);
- ``multi-line``: exit 2 without exactly one ``error:`` line on stderr;
- ``unsafe output``: a control character other than newline and tab on stdout or stderr.

The parent imports the CLI once and forks a child per case (the child's import is free), so
the run is bounded by the commands themselves (about 0.3 s of CPU per case). Prints the counts per class and family and
the first ``--show`` cases of each bad class (argv, files, the tail of stderr). Exit status 1
when any class is non-zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import tomllib
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan import cli  # noqa: E402  (after the path: run from a checkout)
from meshplan.comm.calibration import calibration_toml  # noqa: E402
from meshplan.comm.linkfit import LinkFit  # noqa: E402

CLASSES = ("traceback", "hang", "memory", "multi-line", "unsafe output")
BASES = ["seed-64gpu.toml", "seed-64gpu-tp4.toml", "mini_2x4_tp2-dp4.toml", "mixtral-8x7b_32xh100_ep8-dp32.toml"]
NCCL16 = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 2
[training]
global_batch = 64
seq_len = 4096
[mesh]
names = ["dp_shard", "tp"]
shape = [2, 8]
"""
EXPLICIT = {  # every field given: model and cluster tables without the catalog
    "model": {"name": "tiny", "layers": 4, "hidden": 1024, "ffn": 4096, "q_heads": 16, "kv_heads": 4, "vocab": 32000},
    "cluster": {"name": "box", "nodes": 2, "gpu": "h100-sxm5-80gb",
                "node": {"name": "n", "gpus": 4, "fabric": {"name": "nvl", "bandwidth_gb_per_s": 450.0, "latency_us": 1.0},
                         "pcie": {"name": "pcie", "bandwidth_gb_per_s": 64.0, "latency_us": 2.0},
                         "sockets": [{"gpus": [0, 1], "cores": 32}, {"gpus": [2, 3], "cores": 32}],
                         "nics": [{"name": "mlx5_0", "rate_gbit_per_s": 400.0, "gpus": [0, 1], "rail": 0},
                                  {"name": "mlx5_1", "rate_gbit_per_s": 400.0, "gpus": [2, 3], "socket": 1, "rail": 1}]},
                "network": [{"name": "leaf", "latency_us": 5.0}]},
    "training": {"global_batch": 32, "seq_len": 2048, "micro_batch": 1, "sharding": "zero3"},
    "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4]},
    "memory": {},
}

# ------------------------------------------------------------------ TOML writer


def _key(k: str) -> str:
    return json.dumps(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (\uXXXX escapes)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(doc: dict) -> str:
    out = []
    for table, body in doc.items():
        if isinstance(body, dict):
            out.append(f"[{_key(table)}]")
            out += [f"{_key(k)} = {_value(v)}" for k, v in body.items()]
        else:
            out.insert(0, f"{_key(table)} = {_value(body)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ mutations

WEIRD = [[], {}, ["h100"], "", "x" * 30000, "\x1b[2J", "a\nb", "\u202e", 2**63, 2**64, 2**31, 2**31 - 1, -1, 0, 1,
         4194304, 100000, 10**30, 1e-300, 1e300, float("inf"), float("-inf"), float("nan"), True, False, 0.5, "-1",
         {"a": 1}, [1, 2, 3], [[1]], 2**53 + 1, -(2**63), 65536, 3, "llama3-8b", "dgx-h100", "../../etc/passwd"]


def _paths(doc, prefix=()):
    for k, v in doc.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def _get_parent(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    return doc


def mutate_dict(rng: random.Random, doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = list(_paths(doc))
        if not paths:
            break
        path = rng.choice(paths)
        parent = _get_parent(doc, path)
        op = rng.random()
        if op < 0.1 and isinstance(parent[path[-1]], list) and parent[path[-1]]:  # one list element
            parent[path[-1]][rng.randrange(len(parent[path[-1]]))] = rng.choice(WEIRD)
        elif op < 0.55:
            parent[path[-1]] = rng.choice(WEIRD)
        elif op < 0.65:
            del parent[path[-1]]
        elif op < 0.75:
            parent[rng.choice(["bogus", "Names", "", "x" * 300, "\x07"])] = rng.choice(WEIRD)
        elif op < 0.85:
            v = parent[path[-1]]
            if isinstance(v, int) and not isinstance(v, bool):
                parent[path[-1]] = rng.choice([v * 1000, -v, v + 1, 2**rng.randint(20, 70), v * 2**20])
            elif isinstance(v, float):
                parent[path[-1]] = rng.choice([v * 1e10, -v, float("nan"), 1e308, 5e-324])
            else:
                parent[path[-1]] = rng.choice(WEIRD)
        else:
            doc[rng.choice(["extra", "", "model ", "Mesh", "search", "memory"])] = rng.choice([{}, {"x": 1}, 3, []])
    return doc


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    op = rng.randrange(9)
    b = bytearray(data)
    if op == 0 and b:  # byte flips
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:  # truncation
        b = b[:rng.randrange(len(b) + 1)]
    elif op == 2:
        return data.decode("utf-8", "replace").encode(rng.choice(["utf-16", "utf-16-le", "utf-32", "latin-1"]),
                                                       "replace")
    elif op == 3:  # invalid UTF-8 / control bytes
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = rng.choice([b"\xff\xfe", b"\xc3", b"\x00", b"\x1b[2J", b"\r", b"\x0c", b"\xed\xa0\x80"])
    elif op == 4:  # a long run of one byte
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = rng.choice([b" ", b"9", b"[", b"a", b"\n", b"<pci>", b"-"]) * rng.choice([100, 5000, 200000])
    elif op == 5:  # duplicate a slice
        i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        b[j:j] = b[i:j] * rng.randint(1, 50)
    elif op == 6:  # a line removed
        lines = data.split(b"\n")
        if lines:
            del lines[rng.randrange(len(lines))]
        return b"\n".join(lines)
    elif op == 7:  # a number replaced
        s = data.decode("utf-8", "replace")
        import re
        nums = list(re.finditer(r"\d+(\.\d+)?", s))
        if nums:
            m = rng.choice(nums)
            s = s[:m.start()] + rng.choice(["nan", "inf", "-1", "0", "1e400", "9" * 5000, "1e-320", "-0"]) + s[m.end():]
        return s.encode()
    else:
        return data + rng.choice([b"\n[model]\n", b"\x00" * 10, b"\n" + b"a = 1\n" * 100])
    return bytes(b)


def deep(n: int, open_: str = "[", close: str = "]") -> str:
    return open_ * n + close * n


# ------------------------------------------------------------------ cases


class Case:
    """argv to run in ``folder`` with ``files`` (name -> bytes) written there first; ``fifo``
    names made FIFOs."""

    def __init__(self, family: str, argv: list[str], files: dict[str, bytes], fifo: tuple[str, ...] = (),
                 note: str = ""):
        self.family, self.argv, self.files, self.fifo, self.note = family, argv, files, fifo, note


def _examples() -> dict[str, dict]:
    out = {n: tomllib.loads((ROOT / "examples" / n).read_text()) for n in BASES}
    out["explicit"] = EXPLICIT
    out["nccl16"] = tomllib.loads(NCCL16)
    hf = dict(out["mini_2x4_tp2-dp4.toml"])
    hf["model"] = {"hf_config": "hf.json"}
    out["hf"] = hf
    return out


HF = (ROOT / "tests/data/hf/meta-llama-3-8b/config.json").read_bytes()
HF_QWEN = (ROOT / "tests/data/hf/qwen3-30b-a3b/config.json").read_bytes()


def _command(rng: random.Random, cfg: str) -> list[str]:
    r = rng.random()
    if r < 0.45:
        return ["plan", cfg]
    if r < 0.6:
        return ["groups", cfg, "--rank", str(rng.choice([0, 1, 7]))]
    if r < 0.7:
        return ["step", cfg]
    if r < 0.8:
        return ["place", cfg]
    if r < 0.9:
        return ["reliability", cfg, "--write-gbps", "100", "--read-gbps", "100", "--restart-overhead-s", "60"]
    if r < 0.98:
        return ["nccl-check", cfg, str(ROOT / "tests/data/nccl/dgx-h100x2_world16_dp2_ok.log")]
    return ["search", cfg, "--top", "3"]


SPECIAL = ["/dev/zero", "/dev/null", "fifo", ".", "missing.json", "a\u0000b", "x" * 5000, "loop", "/proc/self/mem",
           "hf.json/"]


def issue_cases() -> list[Case]:
    """The failures listed in issue 13, each once."""
    ex = _examples()
    seed = ex["seed-64gpu.toml"]

    def with_(table, key, value, base=seed):
        d = json.loads(json.dumps(base))
        d.setdefault(table, {})[key] = value
        return d

    docs = [with_("model", "catalog", []), with_("cluster", "gpu", ["h100"]), with_("training", "seq_len", 2**63),
            with_("model", "layers", 2**64), with_("training", "seq_len", float("inf")),
            with_("cluster", "nodes", 2**31), with_("training", "global_batch", 4194304),
            with_("model", "layers", 100000), with_("model", "name", "x" * 30000),
            with_("memory", "fragmentation", float("inf")), with_("search", "top", float("inf"))]
    cases = [Case("config", ["plan", "c.toml"], {"c.toml": to_toml(d).encode()}) for d in docs]
    text = (ROOT / "examples/seed-64gpu.toml").read_text()
    cases += [Case("config", ["plan", "c.toml"], {"c.toml": text.encode("utf-16")}),
              Case("config", ["plan", "c.toml"], {"c.toml": (text + "x = " + deep(2000) + "\n").encode()}),
              Case("config", ["plan", "c.toml"], {"c.toml": text.replace("= 512", "= " + "9" * 5000).encode()}),
              Case("config", ["plan", "c.toml"], {"c.toml": b'[""]\nx = 1\n' + text.encode()})]
    e = ex["explicit"]
    gpus = json.loads(json.dumps(e))
    gpus["cluster"]["node"]["gpus"] = 2**31
    cases.append(Case("config", ["plan", "c.toml"], {"c.toml": to_toml(gpus).encode()}))
    for target in ("/dev/zero", "fifo", ".", "loop"):
        d = with_("model", "hf_config", target, ex["hf"])
        cases.append(Case("config", ["plan", "c.toml"], {"c.toml": to_toml(d).encode()}, fifo=("fifo",)))
    for key, value in (("model_type", ["llama"]), ("num_hidden_layers", "32"), ("hidden_size", 2**70)):
        hf = json.loads(HF)
        hf[key] = value
        cases.append(Case("hf", ["plan", "c.toml"], {"c.toml": to_toml(ex["hf"]).encode(),
                                                     "hf.json": json.dumps(hf).encode()}))
    q = json.loads(HF_QWEN)
    q["decoder_sparse_step"] = 0
    cases.append(Case("hf", ["plan", "c.toml"], {"c.toml": to_toml(ex["hf"]).encode(), "hf.json": json.dumps(q).encode()}))
    return cases


def config_case(rng: random.Random, ex: dict) -> Case:
    name = rng.choice(list(ex))
    doc = ex[name]
    files = {}
    fifo: tuple[str, ...] = ()
    if name == "hf":
        files["hf.json"] = HF if rng.random() < 0.7 else HF_QWEN
    r = rng.random()
    if r < 0.6:
        text = to_toml(mutate_dict(rng, doc)).encode()
    elif r < 0.85:
        text = mutate_bytes(rng, to_toml(doc).encode())
    elif r < 0.92:
        d = json.loads(json.dumps(doc))
        d["model"] = {"hf_config": rng.choice(SPECIAL)}
        fifo = ("fifo",)
        text = to_toml(d).encode()
        files["hf.json"] = HF
    else:
        d = json.loads(json.dumps(doc))
        tbl = rng.choice([t for t in d if isinstance(d[t], dict)])
        key = rng.choice(list(d[tbl]) or ["x"])
        text = (to_toml({t: v for t, v in d.items() if t != tbl}) + f"[{tbl}]\n"
                + "".join(f"{_key(k)} = {_value(v)}\n" for k, v in d[tbl].items() if k != key)
                + f"{_key(key)} = {rng.choice([deep(rng.choice([50, 2000])), '9' * rng.choice([30, 5000]), '1e999', '-nan', repr(chr(27))])}\n").encode()
    files["c.toml"] = text
    cfg = "c.toml"
    argv = _command(rng, cfg) if name != "nccl16" else ["nccl-check", cfg, str(ROOT / "tests/data/nccl/dgx-h100x2_world16_dp2_ok.log")]
    return Case("config", argv, files, fifo, note=name)


def _reader_bases() -> dict[str, tuple[list[bytes], list[str]]]:
    """reader -> (valid inputs, argv with F for the file)."""
    seed = str(ROOT / "examples/seed-64gpu.toml")
    topo = ROOT / "tests/data/topo"
    nccl = ROOT / "tests/data/nccl"
    calib = calibration_toml([LinkFit("nic", "all-reduce", 8, 20e-6, 40e9, 0.01, 0.02, 31),
                              LinkFit("nvlink", "all-reduce", 8, 8e-6, 360e9, 0.01, 0.02, 31)], "fuzz").encode()
    gemm_csv = b"m,n,k,dtype,seconds,tflops,device,torch\n8192,1024,8192,bf16,0.0002,,cpu,2.13\n1024,8192,1024,fp32,,12.5,cpu,2.13\n"
    att = json.dumps({"device": "cpu", "torch": "2.13", "rows": [
        {"op": "attention", "batch": 1, "q_heads": 8, "kv_heads": 1, "seq_q": 8192, "seq_kv": 8192, "head_dim": 128,
         "dtype": "bf16", "forward_s": 0.001, "backward_s": 0.0025},
        {"m": 8192, "n": 1024, "k": 8192, "dtype": "bf16", "seconds": 0.0002}]}).encode()
    nccl16 = "nccl16.toml"
    return {
        "topology": ([topo.joinpath(f).read_bytes() for f in ("seed-8gpu-2nic_topo-m.txt", "dgx-h100-like_topo.xml",
                                                             "dgx-h100-like_topo-m.txt", "nccl-1405_topo.xml")],
                     ["plan", seed, "--topology", "F"]),
        "calibration": ([calib], ["plan", seed, "--calibration", "F"]),
        "nccl-log": ([nccl.joinpath("dgx-h100x2_world16_dp2_ok.log").read_bytes()], ["nccl-check", nccl16, "F"]),
        "nccl-tests": ([nccl.joinpath(f).read_bytes() for f in ("all_reduce_perf_8nodes-x1gpu.txt",
                                                               "all_reduce_perf_8nodes-x1gpu.json",
                                                               "all_reduce_perf_8xa100_s15.txt")],
                       ["calibrate", "F", "--out", "calib-out.toml"]),
        "gemm-table": ([gemm_csv, att], ["step", seed, "--gemm-table", "F"]),
        "hf": ([HF, HF_QWEN], ["plan", "hfc.toml"]),
    }


def _reader_special(reader: str, rng: random.Random, base: bytes) -> bytes:
    """Inputs aimed at one reader's known weak spots."""
    if reader == "topology":
        return rng.choice([
            b"<system>" + b"<pci busid='x'>" * 1000 + b"</pci>" * 1000 + b"</system>",
            b"<system><cpu numaid='0' affinity='0-999999999'>" + b"<gpu dev='0'/>" * rng.choice([9, 20000]) + b"</cpu></system>",
            base.replace(b"0-55,112-167", b"0-999999999"), base.replace(b"speed=\"400000\"", b"speed=\"nan\""),
            base.replace(b"speed=\"400000\"", b"speed=\"-5\""), base.replace(b'dev="0"', b'dev="99999999999999999999"'),
            b"<!DOCTYPE x [<!ENTITY a \"aaaaaaaaaa\"><!ENTITY b \"&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;\">"
            b"<!ENTITY c \"&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;\">]><system>&c;</system>",
            base.replace(b'count="5"', b'count="x"'), base.replace(b"numaid=\"0\"", b"numaid=\"1e9\"")])
    if reader == "nccl-log":
        return rng.choice([b"h:1:1 [0] NCCL INFO " + b" " * 200000 + b"x\n", b"h:1:1 [0] NCCL INFO Ring 00 :" + b" 1" * 100000 + b"\n",
                           b"a" * 300000, base + b"h:1:1 [0] NCCL INFO Trees" + b" [0] 1/-1/-1->0->-1" * 20000 + b"\n",
                           base.replace(b"nRanks 16", b"nRanks 99999999999999999999")])
    if reader == "calibration":
        return rng.choice([base.replace(b"latency_us = 20", b"latency_us = inf"), base.replace(b"bandwidth_gb_per_s = 40", b"bandwidth_gb_per_s = nan"),
                           b"link = 3\n", b"[link]\nnic = 3\n", base + b"[link.nic.x]\n", b"[link.nic]\n" + b"a=[" * 2000])
    if reader == "gemm-table":
        return rng.choice([base.replace(b"12.5", b"0"), base.replace(b"0.0002", b"nan"), base.replace(b"0.0002", b"inf"),
                           b"null", b"[]", b"[1]", b"{\"rows\": 3}", b"m,n,k\n" + b"9" * 200000 + b",1,1\n", b"[" * 100000,
                           base.replace(b"8192", b"99999999999999999999999")])
    if reader == "nccl-tests":
        return rng.choice([base.replace(b"  8 ", b"  nan "), b"{\"results\": null}", b"{\"results\": [null]}", b"null",
                           b"{" * 5000, base.replace(b"Rank  0", b"Rank  99999999999")])
    hf = json.loads(base)
    k = rng.choice(list(hf))
    hf[k] = rng.choice(WEIRD[:30])
    return json.dumps(hf).encode() if rng.random() < 0.8 else b"[" * 100000


def other_case(rng: random.Random, bases) -> Case:
    reader = rng.choice(list(bases))
    inputs, argv = bases[reader]
    base = rng.choice(inputs)
    r = rng.random()
    data = mutate_bytes(rng, base) if r < 0.6 else _reader_special(reader, rng, base)
    fname = "in" + rng.choice([".json", ".csv", ".txt", ".xml", ".toml"]) if reader == "gemm-table" else "in.dat"
    if reader == "gemm-table":
        fname = "in.json" if base.startswith(b"{") else "in.csv"
    files = {"nccl16.toml": NCCL16.encode(), "hfc.toml": to_toml(_examples()["hf"]).encode()}
    fifo: tuple[str, ...] = ()
    target = fname
    if rng.random() < 0.05:
        target = rng.choice(["/dev/zero", "fifo", ".", "missing", "loop"])
        fifo = ("fifo",)
    else:
        files[fname] = data
    if reader == "hf":
        files["hf.json"] = data
        if target != fname:
            files["hfc.toml"] = files["hfc.toml"].replace(b'"hf.json"', json.dumps(target).encode())
        return Case(reader, list(argv), files, fifo)
    return Case(reader, [target if a == "F" else a for a in argv], files, fifo)


# ------------------------------------------------------------------ running


def _limits(mem_mb: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))


_STOP = {signal.SIGINT, signal.SIGTERM}


def start_case(case: Case, args) -> tuple[int, Path]:
    """Fork the child that runs ``case`` under the limits; (pid, its folder)."""
    folder = Path(tempfile.mkdtemp(prefix="fuzz-"))
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    for name in case.fifo:
        os.mkfifo(folder / name)
    os.symlink("loop", folder / "loop")
    pid = os.fork()
    if pid == 0:  # child
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)
        try:
            os.chdir(folder)
            fo = os.open(folder / ".stdout", os.O_WRONLY | os.O_CREAT)
            fe = os.open(folder / ".stderr", os.O_WRONLY | os.O_CREAT)
            os.dup2(fo, 1)
            os.dup2(fe, 2)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # not a caller's capture (pytest)
            sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
            _limits(args.mem_mb, args.cpu_s)
            code = 0
            try:
                cli.main(case.argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        except BaseException:
            os._exit(99)
    return pid, folder


def finish_case(pid: int, folder: Path, status: int | None) -> tuple[str, str]:
    """(class or "ok", detail) of a child that exited with ``status`` (None: killed at the
    wall limit); removes its folder."""
    try:
        if status is None:
            return "hang", "over the wall-clock limit"
        out, err = folder / ".stdout", folder / ".stderr"
        stdout = out.read_bytes() if out.exists() else b""
        stderr = err.read_bytes() if err.exists() else b""
        return classify(status, stdout, stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_case(case: Case, args) -> tuple[str, str]:
    """Run one case to its end: (class or "ok", detail)."""
    return run_cases([case], args, jobs=1)[0]


def run_cases(cases: list[Case], args, jobs: int = 1, progress=None) -> list[tuple[str, str]]:
    """Run ``cases`` with up to ``jobs`` children at a time; results in case order."""
    results: list = [None] * len(cases)
    running: dict[int, tuple[int, Path, float]] = {}
    todo = list(range(len(cases)))[::-1]
    try:
        _loop(cases, args, jobs, progress, results, running, todo)
    finally:  # interrupted: no child outlives the run
        for p, (_, folder, _) in running.items():
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)
            shutil.rmtree(folder, ignore_errors=True)
    return results


def _loop(cases, args, jobs, progress, results, running, todo) -> None:
    while todo or running:
        while todo and len(running) < jobs:
            i = todo.pop()
            # an interruption waits until the child is registered (then it is killed and its folder removed)
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
            try:
                pid, folder = start_case(cases[i], args)
                running[pid] = (i, folder, time.monotonic() + args.wall_s)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, folder, deadline) in list(running.items()):
                if now > deadline:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    del running[p]
                    results[i] = finish_case(p, folder, None)
                    if progress:
                        progress(i, results[i])
            time.sleep(0.005)
            continue
        if pid in running:
            i, folder, _ = running.pop(pid)
            results[i] = finish_case(pid, folder, status)
            if progress:
                progress(i, results[i])


def classify(status: int, stdout: bytes, stderr: bytes) -> tuple[str, str]:
    tail = stderr[-600:].decode("utf-8", "replace")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return ("hang", "CPU limit") if sig in (signal.SIGXCPU, signal.SIGKILL) else ("memory", f"signal {sig}")
    code = os.WEXITSTATUS(status)
    if b"MemoryError" in stderr:
        return "memory", tail
    if b"Traceback (most recent call last)" in stderr or code not in (0, 1, 2):
        return "traceback", f"exit {code}: {tail}"
    if code == 2:
        lines = stderr.decode("utf-8", "replace").splitlines()
        errors = [ln for ln in lines if ln.startswith("error: ")]
        if len(errors) != 1 or len([ln for ln in lines if not ln.startswith("warning: ")]) != 1:
            return "multi-line", tail
    bad = [c for c in (stdout + stderr) if c < 32 and c not in (9, 10) or c == 127]
    if bad:
        return "unsafe output", f"control byte {bad[0]:#x}: {tail}"
    return "ok", ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=10000, help="config cases (the issue's listed cases first)")
    ap.add_argument("--others", type=int, default=2000, help="cases of the other readers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-s", type=int, default=30, help="RLIMIT_CPU per case, seconds")
    ap.add_argument("--wall-s", type=float, default=120.0, help="wall-clock limit per case, seconds (a blocked "
                                                                 "read uses no CPU)")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at a time")
    ap.add_argument("--mem-mb", type=int, default=2048, help="RLIMIT_AS per case, MiB")
    ap.add_argument("--show", type=int, default=3, help="cases shown per bad class")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    ex, bases = _examples(), _reader_bases()
    fixed = issue_cases()
    cases = (fixed + [config_case(rng, ex) for _ in range(max(0, args.configs - len(fixed)))])[:args.configs]
    others = [other_case(rng, bases) for _ in range(args.others)]
    if others:  # interleaved, so that an interrupted run has covered every family in proportion
        step = max(1, len(cases) // len(others))
        mixed = []
        for i, case in enumerate(cases):
            mixed.append(case)
            if i % step == step - 1 and others:
                mixed.append(others.pop(0))
        cases = mixed + others
    counts: Counter = Counter()
    shown: dict[str, list] = {c: [] for c in CLASSES}
    start = time.monotonic()
    done = [0]

    def progress(i: int, result: tuple[str, str]) -> None:
        cls, detail = result
        counts[(cases[i].family, cls)] += 1
        if cls != "ok" and len(shown[cls]) < args.show:
            shown[cls].append((cases[i], detail))
        done[0] += 1
        if done[0] % 500 == 0:
            bad = {c: sum(n for (_, k), n in counts.items() if k == c) for c in CLASSES}
            print(f"... {done[0]}/{len(cases)} cases, {time.monotonic() - start:.0f} s: "
                  + ", ".join(f"{c} {n}" for c, n in bad.items()), file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_cases(cases, args, jobs=args.jobs, progress=progress)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the counts of the cases run so far
        print(f"interrupted after {done[0]} of {len(cases)} cases", flush=True)
    families = sorted({f for f, _ in counts})
    print(f"{done[0]} cases in {time.monotonic() - start:.0f} s "
          f"(limits: {args.cpu_s} s CPU, {args.wall_s:.0f} s wall, {args.mem_mb} MiB address space)")
    print(f"{'family':12s} {'cases':>6s} {'ok':>6s} " + " ".join(f"{c:>13s}" for c in CLASSES))
    for fam in families + ["total"]:
        row = {c: sum(n for (f, k), n in counts.items() if k == c and fam in (f, "total")) for c in CLASSES + ("ok",)}
        total = sum(n for (f, _), n in counts.items() if fam in (f, "total"))
        print(f"{fam:12s} {total:6d} {row['ok']:6d} " + " ".join(f"{row[c]:13d}" for c in CLASSES))
    for cls, items in shown.items():
        for case, detail in items:
            files = {k: (v[:120] + b"..." if len(v) > 120 else v) for k, v in case.files.items() if k.endswith(".toml") or k.startswith("in")}
            print(f"\n[{cls}] {case.family} {case.note} argv={case.argv}\n  files={files}\n  {detail.strip()[-500:]}")
    return 1 if any(n for (_, k), n in counts.items() if k != "ok") else 0


if __name__ == "__main__":
    sys.exit(main())
