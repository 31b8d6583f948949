"""The OpenRLHF 0.11.2 backend: GPU presets run as OpenRLHF Ray PPO jobs with STARE plugged in.

- ``argv``: preset settings + algorithm -> the exact argument list for ``openrlhf.cli.train_ppo_ray`` and the
  STARE settings that travel to the workers in an environment variable (pure; no OpenRLHF import).
- ``data``: the training prompts file (problem + boxed-answer template + label) written before launch.
- ``reward``: the file OpenRLHF loads through ``--reward.remote_url`` (math-verify on the last boxed answer).
- ``plugin``: the one module that reaches into OpenRLHF internals (version-checked): the policy actor
  subclass, the weighted loss, the once-per-step selection and entropy controller, telemetry, checkpoints.
- ``launch``: the driver: Ray, plugin registration, then OpenRLHF's own CLI module.
"""
