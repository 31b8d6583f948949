"""stare.cli.report: the comparison of finished runs, read from their folders and written as tables and plots.

``runs`` reads a local run's folder (config, metrics.jsonl, eval.json, its evaluations) into a ``Run`` and its
measures; ``tensorboard_runs`` reads an OpenRLHF run's TensorBoard log into the same ``Run``; ``tables`` groups runs
into arms and writes comparison.md, .csv and .json; ``dose_response`` adds the table and plot of a swept setting;
``plots`` draws the curves; ``compare`` is ``stare compare`` (a list of folders in, the tables and plots out).
Nothing here trains or evaluates: it reads files and writes the comparison.
"""
