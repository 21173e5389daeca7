"""Search (layer 13): the vectorised candidate space (:mod:`.space`), memory and step-time
bounds over it (:mod:`.memory`, :mod:`.timing`, :mod:`.bounds`, :mod:`.pipeline`), exact
plans of the best candidates (:mod:`.exact`) and the driver (:mod:`.driver`): its vectorised pass
(:mod:`.estimate`), its best-first exact ranking (:mod:`.best_first`) and its notes on settings
that apply to some candidates only (:mod:`.settings_notes`).
"""

__all__ = ["bounds", "driver", "exact", "memory", "pipeline", "space", "timing"]
