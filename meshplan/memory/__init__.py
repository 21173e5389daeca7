"""Memory model: persistent model state (:mod:`.state`) and activations (:mod:`.activations`)."""
