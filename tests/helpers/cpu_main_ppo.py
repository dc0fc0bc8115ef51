"""Stand-in for ``verl.trainer.main_ppo`` in the simulated kuberay run (no GPU, no vLLM here): the same argv of Hydra
overrides that the RayJob's entrypoint passes, composed with verl's own ``ppo_trainer`` config, trained on CPU by
:mod:`pipeline_steps.local.grpo_cpu` (which keeps the metrics history of a resumed run the way the cluster
entrypoint does). ``python -m tests.helpers.cpu_main_ppo key=value ...``."""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # the pod's log
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from pipeline_steps.local import grpo_cpu

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[*argv, "trainer.device=cpu"])
    summary = grpo_cpu.train(cfg, metrics_path=os.environ.get("VERL_FILE_LOGGER_PATH"))
    print(f"trained to step {summary.get('last_step')}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
