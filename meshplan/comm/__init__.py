"""Communication (layer 9): the alpha-beta cost of one collective with nccl-tests' busbw
convention (:mod:`.alphabeta`), the collective table per group and phase
(:mod:`.collectives`: its row type and link path :mod:`.row`, the stage context its builders read
:mod:`.stage_context`, and the rows by technique: :mod:`.tp_rows`, :mod:`.tp_grads`,
:mod:`.dp_rows`, :mod:`.fsdp_rows`, :mod:`.deepspeed_rows`, :mod:`.pp_rows`, :mod:`.ep_rows`),
FSDP2's copies (:mod:`.fsdp2`), DeepSpeed ZeRO-3 of 2021 (:mod:`.deepspeed`) and its ZeRO-1/2
(:mod:`.deepspeed_zero12`), nccl-tests calibration fits (:mod:`.calibration`) and what the
outputs say about them (:mod:`.calibration_notes`), the calibration file from a user's
nccl-tests runs (:mod:`.calibrate`; each file read as a run: :mod:`.calibrate_file`) and the
NCCL log: its reader (:mod:`.nccl_log`), what it holds (:mod:`.nccl_records`) and its check
against the placement (:mod:`.nccl_check`).
Measured busbw curves per link class come from the catalog (``catalog/nccl.toml``).
"""

__all__ = ["alphabeta", "calibrate", "calibrate_file", "calibration", "calibration_notes", "collectives",
           "deepspeed_rows", "dp_rows", "ep_rows", "fsdp_rows", "nccl_check", "nccl_log", "nccl_records", "pp_rows",
           "row", "stage_context", "tp_grads", "tp_rows"]
