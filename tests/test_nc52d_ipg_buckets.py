"""DeepSpeed ZeRO-3 reduce-scatters a layer's gradients once per ipg bucket of reduce_bucket_size
(newcomer trial nc52, finding 14: one call per layer was planned, 80 per micro-batch), counted in
the collective table and summed into the layer's reduction in the rank timeline."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52d"
HF = ["import", "deepspeed", DATA / "ds_z3_hf.json", "--cluster", "dgx-h100", "--nodes", "32", "--model", "llama3-70b",
      "--seq-len", "8192", "--micro-batch", "1", "--grad-accum", "4", "--dtype", "bf16", "--gradient-checkpointing"]


def _plan_rows(tmp_path, capsys, bucket: bool) -> tuple[dict[int, int], list[dict]]:
    """({bytes: calls per micro-batch} of the layers' reduce-scatters, every reduce-scatter row)
    of the trial's job (ds_z3_hf.json: "auto" bucket h^2), or without its bucket (DeepSpeed's 5e8)."""
    out = tmp_path / "z3.toml"
    rc, _, err = run_cli([*HF, "-o", out], capsys)
    assert rc == 0, err
    if not bucket:
        out.write_text(re.sub(r"(?m)^grad_bucket_elements = .*\n", "", out.read_text()))
    rc, _, err = run_cli(["plan", out, "--json", tmp_path / "plan.json"], capsys)
    assert rc == 0, err
    rows: list[dict] = []

    def walk(x):
        if isinstance(x, dict):
            rows.extend([x] if x.get("op") == "reduce-scatter" else [])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(json.loads((tmp_path / "plan.json").read_text()))
    layer = [r for r in rows if r["cadence"].startswith("every layer")]
    return {int(r["size_bytes"]): r["per_microbatch"] for r in layer}, layer


def test_auto_bucket_gives_eight_reduce_scatters_per_layer(tmp_path, capsys):
    """reduce_bucket_size "auto" = h^2 = 67,108,864 (the HF Trainer's fill). By hand, DeepSpeed's
    hook (stage3.py:1533-1535 at edaa722) on a Llama 3 70B layer's gradients in backward order
    (w_down, w_up, w_gate: 8192 x 28672 = 234,881,024 each; MLP norm 8,192; wo 67,108,864; wv, wk
    8,388,608 each; wq 67,108,864; attention norm 8,192): each MLP weight, past the bucket, alone
    (3 calls of 469,762,048 B bf16); the MLP norm alone (wo would take it past h^2); wo alone
    (exactly h^2; wv would take it past); wv + wk (33,554,432 B); wq alone; the attention norm
    alone (the next layer's w_down): 8 calls a layer, x 80 layers per micro-batch = 240 + 160 +
    80 + 160 = 640 (before: 80 of 1,711,308,800 B)."""
    calls, _ = _plan_rows(tmp_path, capsys, True)
    assert calls == {469_762_048: 240, 134_217_728: 160, 33_554_432: 80, 16_384: 160}
    assert sum(calls.values()) == 8 * 80


def test_default_bucket_gives_two_per_layer(tmp_path, capsys):
    """Without reduce_bucket_size, DeepSpeed's 5e8: w_down + w_up = 469,762,048 elements (939,524,096
    B), then w_gate with the rest of the layer, 234,881,024 + 2 x 67,108,864 + 2 x 8,388,608 +
    2 x 8,192 = 385,892,352 elements (771,784,704 B; the next w_down would pass 5e8): 2 a layer."""
    calls, _ = _plan_rows(tmp_path, capsys, False)
    assert calls == {939_524_096: 80, 771_784_704: 80}


def test_timeline_reduces_a_layer_in_its_buckets_time(tmp_path, capsys):
    """The rank timeline's reduce-scatter of a layer (trace event "fsdp RS L79") lasts the sum of
    its buckets' calls (each row's seconds x its calls / 80 layers), not one row's seconds."""
    _, rows = _plan_rows(tmp_path, capsys, True)
    rc, _, err = run_cli(["step", tmp_path / "z3.toml", "--trace", tmp_path / "t.json"], capsys)
    assert rc == 0, err
    doc = json.loads((tmp_path / "t.json").read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    dur = next(e["dur"] for e in events if e.get("name") == "fsdp RS L79") * 1e-6
    summed = sum(r["time_s"] * r["per_microbatch"] / 80 for r in rows)
    assert abs(dur - summed) < 1e-9 and dur > 1.5 * max(r["time_s"] for r in rows)
