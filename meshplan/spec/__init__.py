"""Input specifications (layer 1): one frozen pydantic model per concern (model, cluster,
training, mesh, memory options, search options), the Hugging Face config reader (its model
families: :mod:`.hf_families`) and the axis vocabulary (meshplan, torchtitan and Megatron-LM
names). Unknown keys are rejected; :mod:`meshplan.config` turns validation errors into one-line
:class:`meshplan.errors.ConfigError` messages. Imports only :mod:`meshplan.errors` and
:mod:`meshplan.units`.
"""

__all__ = ["axes", "cluster", "hf", "hf_families", "memory", "memory_buckets", "memory_fields", "mesh", "model",
           "params", "search", "training", "training_cp", "training_engines", "training_fields", "training_precision"]
