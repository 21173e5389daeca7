"""Search (layer 13): the vectorised candidate space (:mod:`.space`), memory and step-time
bounds over it (:mod:`.memory`, :mod:`.timing`, :mod:`.bounds`, :mod:`.pipeline`), exact
plans of the best candidates (:mod:`.exact`) and the best-first driver (:mod:`.driver`).
"""

__all__ = ["bounds", "driver", "exact", "memory", "pipeline", "space", "timing"]
