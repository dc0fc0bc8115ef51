"""Test fixture builder: a REAL verl FSDP checkpoint, made on CPU by verl's own checkpoint manager.

Two processes (gloo, a file:// rendezvous so no port is needed) wrap the tiny model with
verl's own FSDP2 wrapping (``verl.utils.fsdp_utils.apply_fsdp2``: one ``fully_shard`` per
decoder layer and one at the root, a 1-D ``fsdp`` device mesh, so shards are DTensors;
torch's FSDP1 refuses to run without an accelerator, FSDP2 runs on CPU), take one AdamW step so the weights
differ from the base model, and save
with ``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager``. The tracker
file ``latest_checkpointed_iteration.txt`` is written the way verl's trainer writes it.
Rank 0 also saves the full fp32 state dict after the step (``reference_state_dict.pt``,
next to the checkpoints, outside verl's layout) so tests can compare merged weights with it.

Usage from tests: ``build(model_dir, out_dir, steps=(1, 2))`` -> ``out_dir`` (a ``checkpoints`` dir), or
``cached_build(tmp_path_factory.getbasetemp(), model_dir)`` to build once per session.
Run alone: ``python tests/helpers/fsdp_checkpoint.py --model DIR --output DIR``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _worker(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str, steps: list[int]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_full_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})  # verl's strategy=fsdp2 wrapping
        fsdp = model
        optim = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        manager = FSDPCheckpointManager(
            model=fsdp,
            optimizer=optim,
            lr_scheduler=None,
            processing_class=tokenizer,
            checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
        )
        torch.manual_seed(1234)  # same batch on every rank
        ids = torch.randint(0, model.config.vocab_size, (2, 12))
        for step in steps:
            loss = fsdp(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            manager.save_checkpoint(os.path.join(out_dir, f"global_step_{step}", "actor"), global_step=step)
            if rank == 0:  # what verl's trainer does after a save
                Path(out_dir, "latest_checkpointed_iteration.txt").write_text(str(step))
        full = get_fsdp_full_state_dict(fsdp, offload_to_cpu=True, rank0_only=True)
        if rank == 0:
            torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out_dir, "reference_state_dict.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build(model_dir: str | Path, out_dir: str | Path, steps=(1,), world_size: int = 2, timeout: int = 300) -> Path:
    """Write a verl checkpoint tree under ``out_dir`` with one ``global_step_N/actor`` per step."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # TMPDIR: verl's checkpoint manager leaves a ckpt_<hash>.lock in the temporary directory for every folder it
        # makes (the CPU trainer's verl_locks_in); here they go with this directory, not into /tmp for good
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TMPDIR=tmp)
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.fsdp_checkpoint",
            "--model",
            str(model_dir),
            "--output",
            str(out_dir),
            "--world-size",
            str(world_size),
            "--init-file",
            init_file,
            "--steps",
            ",".join(map(str, steps)),
        ]
        procs = [
            subprocess.Popen(
                cmd + ["--rank", str(r)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for r in range(world_size)
        ]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError("FSDP checkpoint builder failed:\n" + "\n".join(o[-3000:] for o in outs))
    return out_dir


def cached_build(base_dir: str | Path, model_dir: str | Path, steps=(1, 2)) -> Path:
    """``build`` once per test session: test modules pass ``tmp_path_factory.getbasetemp()``."""
    final = Path(base_dir) / ("fsdp-checkpoints-" + "-".join(map(str, steps))) / "checkpoints"
    if (final.parent / "complete").is_file():
        return final
    import shutil

    shutil.rmtree(final.parent, ignore_errors=True)
    build(model_dir, final, steps)
    (final.parent / "complete").write_text("ok")  # written last: a crashed build is rebuilt
    return final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", default="1")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--init-file")
    a = ap.parse_args()
    steps = [int(s) for s in a.steps.split(",")]
    if a.rank is None:
        build(a.model, a.output, steps, a.world_size)
    else:
        _worker(a.rank, a.world_size, a.init_file, a.model, a.output, steps)


if __name__ == "__main__":
    main()
