"""The plugins tlt ships, installed as the import package `tlt_plugins` (this folder, plugins/).

Each is found by tlt only through its entry point in the `tlt.plugins` group (pyproject.toml),
exactly as a third party's plugin would be; tlt_cli never imports this package. A plugin
imports tlt_cli freely.
  drafter_sidecar      trains the run's drafter on workers idle in the rollout tail
                       (drafter_sidecar.py; drafter_sidecar_trl.py drives it under TRL)
  tensorboard          logs each step record and the recipe as TensorBoard events (tensorboard_logger.py)
  wandb                logs the same to Weights & Biases, offline unless set up otherwise (wandb_logger.py)
docs/plugins.md describes the hooks they use.
"""
