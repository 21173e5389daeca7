"""docs/launch-validate.md says that validate refuses a DeepSpeed plan and what to validate
instead (newcomer trial nc52, finding 11: the page did not mention DeepSpeed)."""

from __future__ import annotations

from pathlib import Path

from meshplan.config import load_config
from meshplan.mesh.resolve import resolve_mesh
from meshplan.runtime.validation.refusals import runtime_refusals

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "data" / "nc52c" / "job_h100_z3.toml"


def test_launch_validate_page_quotes_the_deepspeed_refusal():
    """job_h100_z3 (zero3_engine "deepspeed", hpZ 8): the runtime's refusal starts "training.zero3_engine
    is 'deepspeed': validate shards parameters with torch's FSDP2; set zero3_engine = "fsdp2""; the
    page quotes that start, in one paragraph, and names the FSDP2 copy as what to validate."""
    cfg = load_config(JOB)
    reasons = runtime_refusals(cfg, resolve_mesh(cfg.mesh, cfg.cluster.world), pipelined=False)
    start = "training.zero3_engine is 'deepspeed': validate shards parameters with torch's FSDP2; " \
            "set zero3_engine = \"fsdp2\""
    assert any(r.startswith(start) for r in reasons)
    page = " ".join((ROOT / "docs" / "launch-validate.md").read_text().split())  # the page's lines joined
    assert start in page
    assert "Validate an FSDP2 copy of the plan" in page
