"""The fix for a size key missing from a Hugging Face ``config.json`` (newcomer trial 26 #2):
``num_local_experts: missing from ... (model_type mixtral); it is required to size the model``
named no fix. :func:`missing_fix` adds one: the key to add, and the catalog model of that family
(read from its published config.json, as its catalog ``source`` says) as the alternative. No
example value: the catalog is a later layer than the specs (docs/layout.md), and the number is
the published config.json's, which the fix points to.
"""

from __future__ import annotations

#: The catalog model that stands for each ``model_type`` (read from that family's published
#: config.json, as its catalog ``source`` says). Families without one get the "add" part alone.
FAMILY_CATALOG = {"llama": "llama3-8b", "mixtral": "mixtral-8x7b",
                  "deepseek_v2": "deepseek-v2", "deepseek_v3": "deepseek-v3"}


def missing_fix(model_type: str, key: str) -> str:
    """What to do about ``key`` missing from a ``model_type`` config.json: add it, or plan that
    family's catalog model instead.

    >>> missing_fix("mixtral", "num_local_experts")
    'add "num_local_experts": N to the config.json, N as in the model\\'s published config.json, or use the catalog model mixtral-8x7b instead of the file (model.catalog, or --model for a foreign config)'
    >>> missing_fix("gpt2", "n_layer")
    'add "n_layer": N to the config.json, N as in the model\\'s published config.json'
    """
    fix = f'add "{key}": N to the config.json, N as in the model\'s published config.json'
    name = FAMILY_CATALOG.get(model_type)
    if name is None:
        return fix
    return f"{fix}, or use the catalog model {name} instead of the file (model.catalog, or --model for a " \
           f"foreign config)"
