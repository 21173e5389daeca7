"""Input specifications: one frozen pydantic model per concern (model, cluster, training,
mesh). Unknown keys are rejected; :mod:`meshplan.spec.config` turns validation errors into
one-line :class:`meshplan.errors.ConfigError` messages."""
