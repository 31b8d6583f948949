"""The local engine: tiny or small policies trained on CPU (or one GPU) with the same stare.algorithms code."""
import os as _os

# transformers imports DeepSpeed (through accelerate) when it is installed, and DeepSpeed's accelerator
# auto-detection warns "Setting accelerator to CPU" in every process on a machine without a GPU. Naming the
# accelerator it would pick anyway keeps that one warning quiet; the local engine never uses DeepSpeed, and a
# GPU machine or a user's own DS_ACCELERATOR is left alone.
if "DS_ACCELERATOR" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["DS_ACCELERATOR"] = "cpu"
