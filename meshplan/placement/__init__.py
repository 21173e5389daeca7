"""Placement (layer 6): rank -> node, GPU, socket, cores, NIC, rail (:mod:`.assign`), its
findings per axis (:mod:`.flags`), the choice of a better rank -> GPU permutation
(:mod:`.choice`; the weak-path bytes it scores: :mod:`.score`) and its explanations
(:mod:`.explain`), per-rank launcher bindings (:mod:`.bindings`), multi-node torchrun, Slurm and
bindings scripts (:mod:`.launch`), and the readers of ``nvidia-smi topo -m`` / NCCL topology
XML (:mod:`.topology`; the node they give: :mod:`.topology_node`) and CPU sets (:mod:`.cpus`).
"""

__all__ = ["assign", "bindings", "choice", "cpus", "explain", "flags", "launch", "score", "topology", "topology_node"]
