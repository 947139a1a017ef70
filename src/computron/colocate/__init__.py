"""Colocation: a training job shares the GPU with inference and hands memory over in milliseconds.

``arbiter`` (pure) decides per device how many bytes inference and training each hold;
``memmodel`` (pure) predicts training's peak memory from its micro-batch size; ``protocol`` is
the handover between processes: the server side (``ArbiterServer``, which the inference engine
asks for its share) and the training side (``Colocation``, one call per micro-batch in any
PyTorch loop). No torch is imported by this package's pure modules.
"""
