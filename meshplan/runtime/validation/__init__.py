"""Validation: ``meshplan validate`` (:mod:`.validate`; its options, :mod:`.options`, and each world's
scaled config, :mod:`.scaling`), the comparison of recorded collectives
with the plan (:mod:`.compare`), evidence (:mod:`.evidence`), the in-run probe (:mod:`.probe`),
step parts (:mod:`.breakdown`), the measured slice (:mod:`.slice`), fake-process-group checks
(:mod:`.dryrun`, :mod:`.memcheck`), kernel timing (:mod:`.kerneltimes`) and one rank of a mesh on the
device against the plan (``bench rank``: :mod:`.one_rank`, its reduced plan :mod:`.one_rank_plan`,
:mod:`.rank_profile`, and the host pace derived from its evidence, :mod:`.host_pace`).
"""

__all__ = ["breakdown", "compare", "dryrun", "evidence", "host_pace", "kerneltimes", "memcheck", "one_rank",
           "one_rank_plan", "options", "probe", "rank_profile", "scaling", "slice", "validate"]
