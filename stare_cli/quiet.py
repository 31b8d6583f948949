"""Library chatter off for the commands that load models: local training (and each arm's worker process) and
``stare eval``."""
from __future__ import annotations

import os


def quiet() -> None:
    """Silence library chatter in this process: the tokenizers library's warning after a fork
    (``TOKENIZERS_PARALLELISM``), the hub's download progress bars, and transformers' info and warning logs and
    progress bars. Python warnings are not filtered: none is printed by a local run (tiny-cpu, smollm-cpu) or by
    either eval harness, and a real one (a deprecation, a run killed mid-line) must reach the user; a known noisy
    third-party warning would get a filter here naming that warning."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - logging tweaks are best effort
        pass
