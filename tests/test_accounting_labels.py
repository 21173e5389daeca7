"""`meshplan plan` prints the three memory accountings the README names: the framework's exact
count (the table), the ZeRO paper's textbook bytes and Megatron-LM's estimate, each labelled."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_seed_plan_prints_zero_and_megatron_accounting():
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", str(EXAMPLES / "seed-64gpu.toml")],
                         capture_output=True, text=True, timeout=120).stdout
    # Llama-3-70B at tp 8: psi = 8,821,940,224 parameters per rank before data parallelism
    # (the state table's params/rank), ZeRO-3 over fsdp 8, K 12:
    # (2 + 2 + 12) * 8,821,940,224 / 8 = 17,643,880,448 B = 16.43 GiB.
    psi, n = 8_821_940_224, 8
    zero3 = 16 * psi / n
    assert f"textbook accounting (ZeRO paper), stage 3: {zero3 / 2**30:.2f} GiB" in out
    assert f"N {n}, K 12 = {zero3:g} B" in out
    # Megatron's estimate: (block / pp + embedding) / tp params x (6 + 12 / dp) B, dp 8:
    # bytes per parameter 6 + 12 / 8 = 7.5 (distributed optimizer shards only optimizer state).
    line = next(x for x in out.splitlines() if x.startswith("Megatron-LM"))
    params = int(line.split("= ")[1].split(" params")[0])
    assert "x 7.5 B" in line and f"{params * 7.5 / 2**30:.2f} GiB" in line
    # the same layer stack as psi minus the norms Megatron divides by tp: within 0.1%
    assert abs(params - psi) / psi < 1e-3
