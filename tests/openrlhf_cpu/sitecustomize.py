"""Installs the test-only OpenRLHF CPU patches (openrlhf_cpu_patches.py) at start-up of every Python process of an
end-to-end run, when ``STARE_E2E_CPU_PATCHES=1`` and this folder and tests/ are on ``PYTHONPATH``."""
import os

if os.environ.get("STARE_E2E_CPU_PATCHES") == "1":
    import openrlhf_cpu_patches

    openrlhf_cpu_patches.install()
