"""Mesh (layer 4): the axis vocabulary (:mod:`.axes`), rank math over any axes
(:mod:`.layout`), degree resolution, derived axes and the expert mesh (:mod:`.resolve`), how
tensor and expert parallelism split each weight (:mod:`.tpsplit`), layers per pipeline stage
(:mod:`.layers`) and the validity rules of a mesh for a model (:mod:`.validity`).
"""

__all__ = ["axes", "layers", "layout", "resolve", "tpsplit", "validity"]
