"""lm-eval task configs (stare_aime24, stare_aime25) with avg@k and math-verify scoring; see utils.py.

``TASKS_DIR`` is the folder to give lm-eval as ``--include_path`` / ``TaskManager(include_path=...)``.
"""
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASKS = {"aime24": "stare_aime24", "aime25": "stare_aime25"}
