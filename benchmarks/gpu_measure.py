"""Issue 11 item 8, on a lent GPU: measure what the catalog holds for this GPU and run one rank of
planned meshes on it, in one call (the device's time is short). Writes into ``--out``:

- ``gemm.toml``: ``bench gemm --grid`` points (kernels.toml form) for ``--gpu``: the catalog's own
  grid for that GPU plus :data:`EXTRA_GEMM` (square shapes and the TP-local shapes of Llama 3
  8B/70B/405B at 2,048-16,384 tokens), bf16, median of 10 after 3 warm-ups;
- ``attention.toml``: ``bench attention --grid`` rows (SDPA forward and backward, causal and not)
  at the catalog's head dims and sequence lengths;
- ``hbm.json``: streaming bandwidth, BabelStream's Copy (``b = a``) and Triad (``a = b + s c``)
  over 2**28 fp32 elements (1 GiB a tensor), bytes counted as read + written, median of 20;
- ``one_rank.json`` and ``one_rank.txt``: :mod:`meshplan.runtime.validation.one_rank` on each of
  :data:`RUNS` (predicted against measured per-layer time and peak memory);
- ``log.txt``: everything printed.

    PYTHONPATH=. python benchmarks/gpu_measure.py --out DIR [--gpu h200-sxm-141gb] [--device cuda|cpu] [--only ...]

``--device cpu`` is a smoke test of the script itself (tiny grids and models); its numbers
describe the CPU. Each part runs in its own try: one failure does not lose the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: GEMMs beyond the catalog's grid: squares, and (tokens, N, K) of the TP-local projections of
#: Llama 3 8B (tp 1: wqkv 6144x4096, wo 4096x4096, w13 28672x4096, w2 4096x14336), 70B at tp 8
#: (qkv 1280x8192, wo 8192x1024, w13 7168x8192, w2 8192x3584) and 405B at tp 8 (qkv 2560x16384,
#: wo 16384x2048, w13 13312x16384, w2 16384x6656), forward only (the backward GEMMs are the same
#: three sizes permuted, measured by ``one_rank`` in place).
SQUARES = [(n, n, n) for n in (512, 1024, 2048, 4096, 8192, 16384)]
LOCAL_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192), (8192, 1024), (7168, 8192),
            (8192, 3584), (2560, 16384), (16384, 2048), (13312, 16384), (16384, 6656)]
EXTRA_GEMM = SQUARES + [(m, n, k) for m in (2048, 8192, 16384) for n, k in LOCAL_NK]
CPU_EXTRA = [(96, 64, 64)]
#: One-rank runs: (name, config path or None, overrides applied to the parsed TOML, layers).
RUNS = [
    ("llama3-405b tp8 x dp_shard128 (examples/, pp dropped), full recompute",
     "examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml", {}, 2),
    ("llama3-405b tp8 x dp_shard128 (examples/, pp dropped), no recompute",
     "examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml", {"training": {"recompute": "none"}}, 2),
    ("llama3-70b tp8 x dp_shard8 (seed), no recompute",
     "examples/seed-64gpu.toml", {"training": {"recompute": "none"}}, 4),
    ("llama3-8b dp_shard8, no recompute", "examples/seed-64gpu.toml",
     {"model": {"catalog": "llama3-8b"}, "mesh": {"names": ["dp_shard"], "shape": [8]},
      "training": {"recompute": "none"}}, 4),
    ("llama3-8b tp4 x dp_shard2 (SP), no recompute", "examples/seed-64gpu.toml",
     {"model": {"catalog": "llama3-8b"}, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4]},
      "training": {"recompute": "none"}}, 4),
    ("llama3-70b tp8 x dp_shard8 (seed), micro-batch 2, no recompute",
     "examples/seed-64gpu.toml", {"training": {"recompute": "none", "micro_batch": 2}}, 4),
]
CPU_MODEL = {"layers": 2, "hidden": 256, "ffn": 512, "q_heads": 8, "kv_heads": 4, "vocab": 1024, "name": "tiny"}


def log(out: Path, *parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(out / "log.txt", "a") as f:
        f.write(line + "\n")


def part(out: Path, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
        log(out, f"[{name}] done in {time.perf_counter() - t0:.1f} s")
    except Exception:
        log(out, f"[{name}] FAILED after {time.perf_counter() - t0:.1f} s\n{traceback.format_exc()}")


def gemm(out: Path, gpu: str, device: str) -> None:
    from meshplan.runtime.bench import grid

    pts = grid.gemm_grid(gpu, "bf16", device) + (CPU_EXTRA if device == "cpu" else EXTRA_GEMM)
    pts = list(dict.fromkeys(pts))
    dt = "fp32" if device == "cpu" else "bf16"
    rows = grid.sweep_gemm(pts, dt, device, warmup=3, repeats=10)
    for r in rows:
        log(out, f"gemm {r[0]:6d} {r[1]:6d} {r[2]:6d} {dt} {r[3]:9.2f} TFLOP/s")
    text = grid.fragment_toml(gpu, grid.source_line("gemm", device), gemm={dt: rows})
    (out / "gemm.toml").write_text(text)


def attention(out: Path, gpu: str, device: str) -> None:
    from meshplan.runtime.bench import grid

    dt = "fp32" if device == "cpu" else "bf16"
    g = grid.attention_grid(gpu, device)
    if device != "cpu":
        g.setdefault(96, list(g.get(128, [512, 1024, 2048, 4096, 8192, 16384])))
    rows = grid.sweep_attention(dict(sorted(g.items())), dt, device, warmup=2, repeats=7)
    for r in rows:
        log(out, f"attention SDPA {r['pass_']:>3} {r['mask']:>6} d{r['head_dim']} {dt}: S {r['seq']} TFLOP/s {r['tflops']}")
    (out / "attention.toml").write_text(grid.fragment_toml(gpu, grid.source_line("attention", device), attention=rows))


def hbm(out: Path, device: str) -> None:
    import torch

    n = 2**28 if device != "cpu" else 2**22
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    res = {}
    for name, fn, nbytes in (("copy", lambda: b.copy_(a), 2 * 4 * n),
                             ("triad", lambda: torch.add(b, c, alpha=0.4, out=a), 3 * 4 * n)):
        times = []
        for i in range(25):
            if device != "cpu":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                dt = s.elapsed_time(e) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if i >= 5:
                times.append(dt)
        res[name + "_tb_per_s"] = nbytes / statistics.median(times) / 1e12
        log(out, f"hbm {name}: {res[name + '_tb_per_s']:.3f} TB/s ({nbytes / 2**30:.2f} GiB moved, median of 20)")
    res.update(elements=n, dtype="fp32", torch=torch.__version__)
    (out / "hbm.json").write_text(json.dumps(res, indent=1) + "\n")


def merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


def one_rank(out: Path, device: str) -> None:
    from meshplan.runtime.validation.one_rank import run, summary

    results = []
    for name, path, over, layers in RUNS:
        data = merge(tomllib.loads((ROOT / path).read_text()), json.loads(json.dumps(over)))
        if device == "cpu":
            data["model"] = dict(CPU_MODEL)
            data["training"]["seq_len"] = 256
            data["mesh"] = {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}
        t0 = time.perf_counter()
        try:
            ev = run(data, layers=layers, device=device, system="auto" if device != "cpu" else None, profile=True)
            ev["name"], ev["wall_s"] = name, time.perf_counter() - t0
            results.append(ev)
            log(out, f"\n{name}\n{summary(ev)}")
            log(out, f"held between steps: {ev.get('held')}")
            for kind, v in (ev.get("profile") or {}).get("kinds", {}).items():
                log(out, f"  profiled step {kind}: {v['seconds'] * 1e3:.2f} ms in {v['kernels']} kernels")
            for t in (ev.get("profile") or {}).get("top", [])[:12]:
                log(out, f"    {t['seconds'] * 1e3:8.3f} ms {t['calls']:5d}x {t['name']}")
        except Exception:
            log(out, f"\n{name}: FAILED\n{traceback.format_exc()}")
            results.append(dict(name=name, error=traceback.format_exc()[-2000:]))
        (out / "one_rank.json").write_text(json.dumps(results, indent=1) + "\n")
        if device != "cpu":
            import torch

            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", default="h200-sxm-141gb")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", default=["hbm", "gemm", "attention", "one_rank"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import torch

    log(a.out, f"torch {torch.__version__}, cuda {torch.version.cuda}, device "
        f"{torch.cuda.get_device_name() if a.device != 'cpu' else 'cpu'}")
    jobs = {"hbm": lambda: hbm(a.out, a.device), "gemm": lambda: gemm(a.out, a.gpu, a.device),
            "attention": lambda: attention(a.out, a.gpu, a.device), "one_rank": lambda: one_rank(a.out, a.device)}
    for name in a.only:
        part(a.out, name, jobs[name])


if __name__ == "__main__":
    main()
