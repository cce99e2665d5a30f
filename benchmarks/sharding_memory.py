"""Parameter and optimizer bytes per device of each `sharding` mode, for the big Transformer.

    python benchmarks/sharding_memory.py [--devices=8] [--tensor_parallel=2] [--vocab_size=37000]

Builds `CONFIG` abstractly (shapes only: no memory, no compilation) on `--devices` forced host
devices and places its parameters and Adam state as a run would (run_setup/sharding.py), then
prints per device the bytes of the parameters, of the optimizer state and their sum, and that sum
against `replicated`'s. The vocabulary is `--vocab_size` (a SentencePiece vocabulary of that size:
the shared en-de one of the paper is about 37000). The figures: docs/performance.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from configs import base  # noqa: E402
from run_setup import command_line  # noqa: E402

MIB = 2**20

# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_integer("devices", 8, "forced host devices", flag_values=FLAGS)
flags.DEFINE_integer("tensor_parallel", 2, "the model axis of fsdp_tp", flag_values=FLAGS)
flags.DEFINE_integer("vocab_size", 37000, "the vocabulary (SentencePiece pieces)", flag_values=FLAGS)
flags.DEFINE_string("config", "configs/wmt14_transformer.py:big", "FILE.py[:ARG]", flag_values=FLAGS)


def main(argv: list[str] | None = None) -> None:
    command_line.parse(FLAGS, argv or sys.argv, __doc__)
    args = FLAGS
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    from flax import nnx

    import models
    from engine import training_loop
    from run_setup import sharding
    from run_setup.cluster import make_mesh
    from run_setup.run import split_model
    from run_setup.settings import parse
    from tasks import vocabularies

    settings = parse(base.load(args.config))
    fields = {
        **settings.model.fields,
        "vocab_size": args.vocab_size,
        "source_vocab_size": args.vocab_size,
        "bos_id": vocabularies.BOS_ID,
        "pad_id": vocabularies.PAD_ID,
    }
    _, abstract_params, _ = split_model(
        nnx.eval_shape(lambda: models.create_model(settings.model.name, rngs=nnx.Rngs(0), **fields))
    )
    tx = training_loop.make_optimizer(settings.optimization)
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract_params))
    print(f"{args.config}: {count / 1e6:.1f}M parameters (vocabulary {args.vocab_size}), {args.devices} devices\n")
    print(
        "| sharding | mesh (data, model) | parameters MiB/device | optimizer MiB/device | total MiB/device "
        "| of replicated |"
    )
    print("|---|---|---|---|---|---|")
    reference = None
    for mode in ("replicated", "fsdp", "fsdp_tp"):
        mesh = make_mesh(jax.devices()[: args.devices], mode, args.tensor_parallel)
        param_shardings = sharding.named_shardings(sharding.partition_specs(abstract_params, mesh, mode), mesh)
        params = sharding.abstract_with_shardings(abstract_params, param_shardings)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        opt_shardings = sharding.optimizer_shardings(tx, params, param_shardings, replicated)
        opt_state = sharding.abstract_with_shardings(jax.eval_shape(tx.init, params), opt_shardings)
        param_bytes, opt_bytes = sharding.bytes_per_device(params), sharding.bytes_per_device(opt_state)
        total = param_bytes + opt_bytes
        reference = reference or total
        shape = f"({mesh.shape['data']}, {mesh.shape['model']})"
        print(
            f"| {mode} | {shape} | {param_bytes / MIB:.1f} | {opt_bytes / MIB:.1f} | {total / MIB:.1f} "
            f"| {total / reference:.3f} |"
        )


if __name__ == "__main__":
    main()
