"""`meshplan plan` prints the three memory accountings the README names: the framework's exact
count (the table), the ZeRO paper's textbook bytes and Megatron-LM's estimate, each labelled."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_seed_plan_prints_zero_and_megatron_accounting():
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", str(EXAMPLES / "seed-64gpu.toml")],
                         capture_output=True, text=True, timeout=120).stdout
    # Llama-3-70B at tp 8: psi = 8,820,367,360 parameters per rank before data parallelism
    # (the state table's params/rank; embedding and output 128256 x 8192 / 8 each, unpadded as
    # torchtitan keeps them: 2 x 768 x 8192 / 8 = 1,572,864 fewer than Megatron's 129024 rows),
    # ZeRO-3 over fsdp 8, K 12: (2 + 2 + 12) * 8,820,367,360 / 8 = 17,640,734,720 B = 16.43 GiB.
    psi, n = 8_820_367_360, 8
    zero3 = 16 * psi / n
    assert f"textbook accounting (ZeRO paper), ZeRO stage 3: {zero3 / 2**30:.2f} GiB" in out
    assert f"N {n}, K 12 = {zero3:g} B" in out
    # Megatron's estimate: (block / pp + embedding) / tp params x (6 + 12 / dp) B, dp 8:
    # bytes per parameter 6 + 12 / 8 = 7.5 (distributed optimizer shards only optimizer state).
    # (at pp 1 plus Megatron's embedding / tp for the untied output layer); the console may wrap the line
    # the seed is zero3 (FSDP): the formula is labelled as if run with Megatron's distributed optimizer (issue 11)
    text = " ".join(out[out.index("Megatron-LM report_theoretical_memory"):].split(" B;")[0].split())
    assert text.startswith("Megatron-LM report_theoretical_memory estimate (approximation), as if run with "
                           "Megatron-LM's distributed optimizer: ")
    params = int(text.split(" params x ")[0].rsplit("= ", 1)[1])
    assert text.endswith(" params x 7.5 B = " + f"{params * 7.5:.0f}") and f"{params * 7.5 / 2**30:.2f} GiB" in text
    assert "+ 1050673152 / tp 8 (untied output layer at pp 1)" in text  # 128256 x 8192 / tp 8, untied
    # the same layer stack as psi minus the norms Megatron divides by tp: within 0.1%
    assert abs(params - psi) / psi < 1e-3
