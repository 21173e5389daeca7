"""Development reference for the compute model: Korthikanti et al. 2022 (arXiv 2205.05198),
22B GPT on one DGX A100 (tp 8, micro-batch 4, seq 2048, Tables 3-5), published times beside
meshplan's prediction. Nothing is fitted to these numbers; other published runs check the
model later. Run: .venv/bin/python benchmarks/compute_22b_reference.py
"""

from meshplan.compute.flops import KORTHIKANTI_22B_MEASURED, korthikanti_model_flops
from meshplan.plan import build_plan
from meshplan.config import config_from_dict
from meshplan.schedule.steptime import layer_unit_times, step_time

PUBLISHED = KORTHIKANTI_22B_MEASURED


def main() -> None:
    print("22B, 1x DGX A100, tp 8, b 4, s 2048, no flash attention, GPT dropout; published (Korthikanti 2022) "
          "vs predicted")
    print(f"{'recompute':10s} {'sp':5s} {'fwd pub':>8s} {'fwd pred':>9s} {'bwd pub':>8s} {'bwd pred':>9s} "
          f"{'step pub':>9s} {'step pred':>10s} {'MFU pred':>9s}")
    for (rec, sp), (pf, pb, ps) in PUBLISHED.items():
        cfg = config_from_dict({
            "model": {"catalog": "megatron-22b"}, "cluster": {"system": "dgx-a100", "nodes": 1},
            "training": {"global_batch": 4, "seq_len": 2048, "micro_batch": 4, "recompute": rec,
                         "flash_attention": False, "sharding": "none", "param_dtype": "bf16"},
            "mesh": {"names": ["tp"], "shape": [8], "sequence_parallel": sp}})
        plan = build_plan(cfg)
        f, b = (x * 1e3 for x in layer_unit_times(plan, dropout=True))
        st = step_time(plan, dropout=True)
        print(f"{rec:10s} {str(sp):5s} {pf:8.1f} {f:9.2f} {pb:8.1f} {b:9.2f} "
              f"{(f'{ps:.2f}' if ps else '-'):>9s} {st.step_s:10.3f} {st.mfu:9.1%}")
    kor = korthikanti_model_flops(4, 2048, 48, 6144, 51200)
    print(f"published MFU 41.5% / HFU 43.7% at 1.10 s use 72 B s L h^2 (1 + s/6h + V/12hL) = {kor / 1e15:.4f} PFLOP "
          f"(full attention); meshplan's MFU counts the causal half.")


if __name__ == "__main__":
    main()
