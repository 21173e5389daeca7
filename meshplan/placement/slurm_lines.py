"""The Slurm-facing lines of ``job.sbatch`` (:func:`meshplan.placement.launch.sbatch_script`): the
srun line asking for the job's CPUs again, the lines finding the folder that holds torchrun.sh,
and the note when that folder is each machine's own.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional


def srun_lines(cores: int) -> list[str]:
    """job.sbatch's srun line with ``--cpus-per-task`` again (its comment says why, with sources):
    the job's ``SLURM_CPUS_PER_TASK`` (else ``cores``), or the node's ``SLURM_CPUS_ON_NODE`` when more."""
    return ["# srun: --cpus-per-task again, since Slurm 22.05 srun does not inherit sbatch's (Slurm 22.05 release",
            "# notes; sbatch man page, --cpus-per-task, and SRUN_CPUS_PER_TASK): without it the step gets one CPU",
            "# per task under task/cgroup and bind.sh's numactl --physcpubind falls outside the step's cpuset.",
            "# Every CPU of the node (SLURM_CPUS_ON_NODE, --exclusive) when more: where Slurm counts hardware threads",
            "# as CPUs, the cores' count of CPUs is half the cores (both threads each) and some binds would miss.",
            f"cpus=${{SLURM_CPUS_PER_TASK:-{cores}}}",
            'if [ "${SLURM_CPUS_ON_NODE:-0}" -gt "$cpus" ]; then cpus=$SLURM_CPUS_ON_NODE; fi',
            'srun --ntasks-per-node=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1 --cpu-bind=none "$dir/torchrun.sh"',
            ""]


def find_folder_lines(folder: Path) -> list[str]:
    """job.sbatch's lines that set ``dir`` to the folder holding torchrun.sh (:func:`meshplan.placement.launch.sbatch_script`);
    the path only ever written through :func:`shlex.quote`, in an assignment."""
    where = shlex.quote(os.path.normpath(folder))
    here = where if folder.is_absolute() else f'"$submit"/{where}'
    return ["# torchrun.sh and bind.sh lie beside this script, on a filesystem every node sees. sbatch runs a copy",
            "# of it, so they are looked for in $here (--out, under the submit directory when relative), then in",
            "# the submit directory itself; MESHPLAN_LAUNCH_DIR overrides both.",
            'submit=${SLURM_SUBMIT_DIR:-$PWD}', f"here={here}",
            'dir=${MESHPLAN_LAUNCH_DIR:-}',
            'for d in "$here" "$submit"; do',
            '  if [ -z "$dir" ] && [ -x "$d/torchrun.sh" ]; then dir=$d; fi', "done",
            'if [ -z "$dir" ]; then',
            '  echo "meshplan job.sbatch: no torchrun.sh in $here or $submit on $(hostname): submit from the folder '
            'meshplan launch wrote, or from where it ran, on a filesystem the compute nodes share, or set '
            'MESHPLAN_LAUNCH_DIR" >&2; exit 1', "fi"]


#: Folders that are each machine's own on a cluster by convention (the FHS: /tmp and /var/tmp
#: are local temporary storage; /dev/shm is memory), where the compute nodes cannot see the scripts.
LOCAL_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")


def local_folder_note(folder) -> Optional[str]:
    """A one-line note when ``folder`` resolves under :data:`LOCAL_ROOTS`: the compute nodes run
    job.sbatch's torchrun.sh and bind.sh from it, so it must be on a filesystem they share.

    >>> local_folder_note("/tmp/launch").split(":")[0]
    'note'
    >>> local_folder_note("/home/me/launch") is None
    True
    """
    where = Path(folder).resolve()
    root = next((r for r in LOCAL_ROOTS if where.is_relative_to(r)), None)
    if root is None:
        return None
    return (f"note: {where} is under {root}, local to each "
            f"machine on most clusters: the compute nodes run torchrun.sh and bind.sh from this folder, so write "
            f"it (--out) on a filesystem they share")
