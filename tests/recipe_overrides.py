"""Overrides for tests that run the default recipe: its TLT machinery off, and the small run they share.

The default recipe speculates (adaptive) and trains the drafter on idle workers. The drafter's
training depends on idle time, so runs compared step for step (resume, launchers) use plain
decoding, which also spares every test the drafter warm-up.
"""

import sys
from pathlib import Path

PLAIN_DECODING = ("speculative.mode=off", "plugins.enabled=[]")
TLT = [sys.executable, "-m", "tlt_cli"]
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
# metrics of a step that do not depend on wall-clock time: what runs compared step for step must agree on
DETERMINISTIC = (
    "mean_reward",
    "response_length_p50",
    "response_length_max",
    "response_tokens",
    "actor_loss",
    "actor_grad_norm",
)


def small_run(model: Path, output: Path, name: str, steps: int, *extra: str) -> list[str]:
    """`tlt train` of the default recipe on `model`, plain decoding, 4 prompts x 2 samples of at most
    48 tokens a step, a checkpoint every 2 steps, into `output`/`name`; `extra` overrides last."""
    return [
        *TLT,
        "train",
        str(RECIPE),
        f"model.path={model}",
        *PLAIN_DECODING,
        f"run.output_dir={output}",
        f"run.name={name}",
        f"train.steps={steps}",
        "train.prompts_per_step=4",
        "train.group_size=2",
        "rollout.max_new_tokens=48",
        "checkpoint.every=2",
        *extra,
    ]
