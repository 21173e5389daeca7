"""meshplan: design, check and validate parallel meshes for distributed training.

Flow: spec -> mesh (layout, groups) -> placement -> shapes -> memory -> collectives ->
report. Only :mod:`meshplan.runtime` imports torch.distributed.
"""

__version__ = "0.1.0"
