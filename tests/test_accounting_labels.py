"""`meshplan plan` prints the three memory accountings the README names: the framework's exact
count (the table), the ZeRO paper's textbook bytes and, under framework megatron only, Megatron-LM's
estimate, each labelled."""

from pathlib import Path

from tests.cli_run import run_captured

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _plan_out(path) -> str:
    return run_captured("plan", path).stdout  # in-process: what the console script prints


def test_seed_plan_prints_zero_accounting_and_no_megatron_estimate():
    """The seed is a torch plan (training.framework unset): Megatron-LM's estimate, that run's
    own log line, is not printed (a newcomer read its number beside the torch plan's state as
    the plan's)."""
    out = _plan_out(EXAMPLES / "seed-64gpu.toml")
    # Llama-3-70B at tp 8: psi = 8,820,367,360 parameters per rank before data parallelism
    # (the state table's params/rank; embedding and output 128256 x 8192 / 8 each, unpadded as
    # torchtitan keeps them), ZeRO-3 over fsdp 8, K 12: (2 + 2 + 12) * psi / 8 = 17,640,734,720 B = 16.43 GiB.
    psi, n = 8_820_367_360, 8
    zero3 = 16 * psi / n
    assert f"textbook accounting (ZeRO paper), ZeRO stage 3: {zero3 / 2**30:.2f} GiB" in out
    assert f"N {n}, K 12 = {zero3:g} B" in out
    assert "report_theoretical_memory" not in out and "Megatron-LM's distributed optimizer" not in out


def test_seed_under_megatron_prints_megatron_estimate(tmp_path):
    seed = (EXAMPLES / "seed-64gpu.toml").read_text()
    f = tmp_path / "seed-megatron.toml"
    f.write_text(seed.replace('sharding = "zero3"', 'framework = "megatron"\nsharding = "zero3"', 1))
    out = _plan_out(f)
    # Megatron pads the vocabulary to a multiple of 128 x tp 8 = 1024: 129024 rows, so psi is the
    # seed's 8,820,367,360 + 2 x 768 x 8192 / 8 = 8,821,940,224
    psi = 8_821_940_224
    assert f"ZeRO stage 3: {16 * psi / 8 / 2**30:.2f} GiB" in out and f"N 8, K 12 = {16 * psi / 8:g} B" in out
    # Megatron's estimate: (block / pp + embedding) / tp params x (6 + 12 / dp) B, dp 8:
    # bytes per parameter 6 + 12 / 8 = 7.5 (distributed optimizer shards only optimizer state),
    # at pp 1 plus embedding / tp for the untied output layer; the console may wrap the line.
    # zero3 (FSDP): labelled as if run with Megatron's distributed optimizer (issue 11)
    text = " ".join(out[out.index("Megatron-LM report_theoretical_memory"):].split(" B;")[0].split())
    assert text.startswith("Megatron-LM report_theoretical_memory estimate (approximation), as if run with "
                           "Megatron-LM's distributed optimizer: ")
    params = int(text.split(" params x ")[0].rsplit("= ", 1)[1])
    assert text.endswith(" params x 7.5 B = " + f"{params * 7.5:.0f}") and f"{params * 7.5 / 2**30:.2f} GiB" in text
    assert "+ 1056964608 / tp 8 (untied output layer at pp 1)" in text  # 129024 x 8192 / tp 8, untied
    # the same layer stack as psi minus the norms Megatron divides by tp: within 0.1%
    assert abs(params - psi) / psi < 1e-3


def test_moe_with_ep_prints_why_the_megatron_estimate_is_not_shown():
    """Newcomer trial 17: DeepSeek-V3 at pp 16 x dp_shard 128 x ep 64 printed "Megatron-LM
    report_theoretical_memory estimate: 242.58 GiB" and then that the formula ignores expert
    parallelism. Now no number, one line saying why: 256 experts / ep 64 = 4 per rank, where the
    formula counts all 256 on every rank."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.report.text import _accounting_lines
    plan = build_plan(load_config(EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"))
    lines = _accounting_lines(plan, plan.state[0])
    assert len(lines) == 2 and lines[0].startswith("textbook accounting (ZeRO paper)")
    assert lines[1] == ("Megatron-LM report_theoretical_memory estimate: not shown: its formula ignores expert "
                        "parallelism and counts all 256 experts of every MoE layer on every rank, where ep 64 x etp 1 "
                        "leaves 4 per rank (the exact count above holds them)")
    out = _plan_out(EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    flat = " ".join(out.split())
    assert "242.58 GiB" not in flat and "(approximation)" not in flat and lines[1] in flat
