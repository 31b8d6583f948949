"""The local engine: tiny or small policies trained on CPU (or one GPU) with the same stare.algorithms code.

Importing the package imports nothing heavy: ``tasks`` is plain Python (the preset schema reads its task names),
and torch and transformers load with ``policy`` and the modules that use it.
"""
