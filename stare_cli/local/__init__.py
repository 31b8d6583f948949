"""The local engine: tiny or small policies trained on CPU (or one GPU) with the same stare.algorithms code."""
