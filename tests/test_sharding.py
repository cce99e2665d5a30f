"""Parameters and optimizer state sharded by `sharding` (run_setup/sharding.py) on the 8 forced host
devices: the three modes train alike, each parameter and its Adam moments sit where the rule table
says, and a checkpoint moves between modes and device counts exactly.

Tiny Transformer (d_model 16, d_ff 32, 2 heads), float32, no dropout: three steps per mode.
"""

import dataclasses
import types

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import input_pipeline
from engine import evaluation, training_loop
from engine.evaluation import Evaluator
from helpers.tiny import first_devices_mesh, tiny_config
from run_setup import cluster, compatibility, sharding
from run_setup import run as run_module
from run_setup.run import prepare_run
from run_setup.settings import parse, read_run_settings, write_run_config
from utils.errors import ConfigError

# about the device count
pytestmark = pytest.mark.all_devices

# mode -> tensor_parallel
MODES = {"replicated": 1, "fsdp": 1, "fsdp_tp": 2}


def sharded_settings(data_dir, mode, tensor_parallel=1, **overrides):
    return parse(
        tiny_config(
            data_dir, sharding=mode, tensor_parallel=tensor_parallel, **{"model.dropout_rate": 0.0}, **overrides
        )
    )


def first_batches(run, count=3):
    data, _ = input_pipeline.train_dataset(
        run.task, run.tokens, run.settings.data, run.settings.source, process_index=0, process_count=1
    )
    iterator = iter(data)
    try:
        return [next(iterator) for _ in range(count)]
    finally:
        iterator.close()


def train_steps(run, batches):
    """`(state, losses)` after one update per batch."""
    tx = training_loop.make_optimizer(run.settings.optimization)
    state = training_loop.initial_state(run, tx)
    step = training_loop.compile_train_step(run, tx, state)
    losses = []
    for batch in batches:
        state, step_metrics = step(state, run.global_batch(batch))
        losses.append(float(step_metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def trained(shared_data_dir, tmp_path_factory):
    """Each mode's `(run, state after 3 steps, losses)`, on the same batches; one workdir (one vocabulary)."""
    workdir = tmp_path_factory.mktemp("sharded")
    runs = {mode: prepare_run(sharded_settings(shared_data_dir, mode, tp), workdir) for mode, tp in MODES.items()}
    batches = first_batches(runs["replicated"])
    return {mode: (run, *train_steps(run, batches)) for mode, run in runs.items()}


def leaves(tree):
    """`{"encoder_layers.0.feed_forward.inner.kernel": array, ...}`."""
    named = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value"): leaf for path, leaf in named}


def test_the_three_modes_train_to_the_same_losses_and_parameters(trained):
    _, reference_state, reference_losses = trained["replicated"]
    reference = leaves(reference_state["params"])
    for mode in ("fsdp", "fsdp_tp"):
        _, state, losses = trained[mode]
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, err_msg=mode)
        # the steps did update
        assert reference_losses[0] != reference_losses[-1]
        for name, value in leaves(state["params"]).items():
            np.testing.assert_allclose(
                np.asarray(value), np.asarray(reference[name]), rtol=1e-4, atol=1e-7, err_msg=f"{mode} {name}"
            )


# Where the table puts the tiny model's parameters: (data 8) for fsdp, (data 4, model 2) for fsdp_tp.
# The embedding's vocabulary rows go along `model` only where 2 divides them.
EXPECTED = {
    "fsdp": {
        "encoder_layers.0.feed_forward.inner.kernel": P("data", None),
        "encoder_layers.0.feed_forward.inner.bias": P(None),
        "encoder_layers.0.feed_forward.outer.kernel": P(None, "data"),
        "encoder_layers.0.self_attention.query.kernel": P("data", None),
        "decoder_layers.0.cross_attention.out.kernel": P(None, "data"),
        "source_embed.embedding.embedding": P(None, "data"),
        "encoder_layers.0.attention_residual.norm.scale": P(None),
    },
    "fsdp_tp": {
        "encoder_layers.0.feed_forward.inner.kernel": P("data", "model"),
        "encoder_layers.0.feed_forward.inner.bias": P("model"),
        "encoder_layers.0.feed_forward.outer.kernel": P("model", "data"),
        "encoder_layers.0.self_attention.query.kernel": P("data", "model"),
        "decoder_layers.0.cross_attention.out.kernel": P("model", "data"),
        "encoder_layers.0.attention_residual.norm.scale": P(None),
    },
}


@pytest.mark.parametrize("mode", ["fsdp", "fsdp_tp"])
def test_parameters_and_their_adam_moments_sit_where_the_table_says(trained, mode):
    run, state, _ = trained[mode]
    params = leaves(state["params"])
    vocab = params["source_embed.embedding.embedding"].shape[0]
    expected = dict(EXPECTED[mode])
    if mode == "fsdp_tp":
        expected["source_embed.embedding.embedding"] = P("model" if vocab % 2 == 0 else None, "data")
    assert dict(run.mesh.shape) == ({"data": 8, "model": 1} if mode == "fsdp" else {"data": 4, "model": 2})
    for name, spec in expected.items():
        assert params[name].sharding.spec == spec, name
    for moment in ("mu", "nu"):
        moments = leaves(optax.tree_utils.tree_get(state["opt_state"], moment))
        assert moments.keys() == params.keys()
        for name, value in moments.items():
            assert value.sharding == params[name].sharding, f"{moment} {name}"
    kernel = params["encoder_layers.0.feed_forward.inner.kernel"]
    assert kernel.addressable_shards[0].data.shape == ((16 // 8, 32) if mode == "fsdp" else (16 // 4, 32 // 2))
    replicated = trained["replicated"][1]
    assert all(
        leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves((replicated["params"], replicated["opt_state"]))
    )


def test_a_search_gathers_the_data_axis_and_keeps_the_model_axis():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    specs = [P("data", "model"), P("model", "data"), P(("data", "model"), None), P(("model", "data")), P(None), P()]
    shardings = sharding.without_data_axis([NamedSharding(mesh, spec) for spec in specs])
    assert [s.spec for s in shardings] == [
        P(None, "model"),
        P("model", None),
        P("model", None),
        P("model"),
        P(None),
        P(),
    ]
    assert all(s.mesh == mesh for s in shardings)


def test_a_search_under_fsdp_decodes_what_a_replicated_one_does_and_gathers_only_what_fits(trained):
    """The same parameters, replicated or sharded by fsdp (gathered whole for the search): the same
    hypotheses. Where the whole parameters would not fit in a quarter of a device, they stay sharded."""
    replicated, fsdp = trained["replicated"][0], trained["fsdp"][0]
    params = {"replicated": replicated.params, "fsdp": jax.device_put(replicated.params, fsdp.param_shardings)}
    assert not any(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params["fsdp"]) if leaf.ndim == 2)
    batch = next(Evaluator(replicated).batches("dev"))[0]
    outputs = {
        mode: Evaluator(run).decode(params[mode], batch["inputs"], jax.random.key(0))
        for mode, run in (("replicated", replicated), ("fsdp", fsdp))
    }
    np.testing.assert_array_equal(np.asarray(outputs["fsdp"][0]), np.asarray(outputs["replicated"][0]))
    np.testing.assert_allclose(np.asarray(outputs["fsdp"][1]), np.asarray(outputs["replicated"][1]), rtol=1e-5)

    # fsdp on (data 8): whole
    assert all(s.is_fully_replicated for s in jax.tree.leaves(fsdp.search_shardings))
    # every parameter whole
    whole = sharding.bytes_per_device(replicated.params)
    # a quarter of it holds half of them
    small = dataclasses.replace(fsdp, device_memory=2 * whole)
    assert jax.tree.leaves(small.search_shardings) == jax.tree.leaves(fsdp.param_shardings)


def gathered(tree):
    return {name: np.asarray(value) for name, value in leaves(tree).items()}


def saved_under_fsdp(trained, workdir):
    """A run folder (config.json, vocabulary, a checkpoint at step 3) of the `fsdp` run's state on 8 devices."""
    fsdp_run, state, _ = trained["fsdp"]
    from run_setup.checkpoints import Checkpoints

    saver = Checkpoints(workdir / "checkpoints")
    saver.save(3, state, None)
    saver.close()
    write_run_config(fsdp_run.settings, workdir)
    (workdir / "tokenizer").symlink_to(fsdp_run.workdir / "tokenizer")
    return state


def test_a_checkpoint_saved_under_fsdp_restores_exactly_under_fsdp_tp_on_four_devices_and_on_one(
    trained, shared_data_dir, tmp_path
):
    saved = gathered(saved_under_fsdp(trained, tmp_path))
    for mode, devices in (("fsdp_tp", jax.devices()), ("fsdp", jax.devices()[:4]), ("replicated", jax.devices()[:1])):
        run = prepare_run(
            sharded_settings(shared_data_dir, mode, MODES[mode]), tmp_path, devices=devices, with_data=False
        )
        abstract = run.abstract(
            training_loop.initial_state(run, training_loop.make_optimizer(run.settings.optimization))
        )
        step, restored = run.checkpoints.restore(abstract)
        run.checkpoints.close()
        assert step == 3
        for name, value in leaves(restored).items():
            assert value.sharding == leaves(abstract)[name].sharding, f"{mode} {name}"
            np.testing.assert_array_equal(
                np.asarray(value), saved[name], err_msg=f"{mode} on {len(devices)} devices: {name}"
            )
    import inference

    # one device, replicated, whatever the run's sharding
    translator = inference.load(tmp_path)
    assert {len(p.sharding.device_set) for p in jax.tree.leaves(translator.params)} == {1}
    for name, value in gathered(translator.params).items():
        np.testing.assert_array_equal(value, saved[f"params.{name}"], err_msg=name)


def test_eval_mode_scores_an_fsdp_run_alike_under_fsdp_fsdp_tp_and_on_one_device(
    trained, shared_data_dir, tmp_path, monkeypatch
):
    """`--mode=eval` of a run saved under `fsdp` on 8 devices, as train.py sets it up: as saved,
    under `fsdp_tp` (its command line's `sharding`), and replicated on a one-device machine."""
    saved_under_fsdp(trained, tmp_path)
    saved = read_run_settings(tmp_path)
    results, meshes = {}, {}
    for mode, devices in (("fsdp", 8), ("fsdp_tp", 8), ("replicated", 1)):
        requested = sharded_settings(shared_data_dir, mode, MODES[mode])
        make_mesh = first_devices_mesh(devices)
        monkeypatch.setattr(
            run_module, "make_mesh", lambda *args, **kwargs: meshes.setdefault(mode, make_mesh(*args, **kwargs))
        )
        results[mode] = evaluation.evaluate(
            compatibility.for_evaluation(saved, requested, ["sharding", "tensor_parallel"]), tmp_path
        )
    assert {mode: dict(mesh.shape) for mode, mesh in meshes.items()} == {
        "fsdp": {"data": 8, "model": 1},
        "fsdp_tp": {"data": 4, "model": 2},
        "replicated": {"data": 1, "model": 1},
    }
    # the whole dev split
    assert results["fsdp"]["decoded_examples"] == 24
    for mode in ("fsdp_tp", "replicated"):
        assert results[mode].keys() == results["fsdp"].keys()
        for name, value in results["fsdp"].items():
            np.testing.assert_allclose(results[mode][name], value, rtol=1e-5, err_msg=f"{mode}: {name}")


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"sharding": "fsdp_tp", "tensor_parallel": 3}, ("tensor_parallel 3", "8 devices")),
        ({"sharding": "fsdp", "tensor_parallel": 2}, ("tensor_parallel 2", "'fsdp'")),
        ({"sharding": "zero3"}, ("sharding", "'zero3'")),
    ],
)
def test_a_mesh_that_does_not_fit_stops_naming_both_numbers(shared_data_dir, tmp_path, overrides, named):
    with pytest.raises(ConfigError) as error:
        prepare_run(parse(tiny_config(shared_data_dir, **overrides)), tmp_path / "never")
    assert all(part in str(error.value) for part in named), str(error.value)
    assert len(str(error.value).splitlines()) == 1
    assert not (tmp_path / "never").exists()


def test_a_tensor_parallel_group_across_processes_stops_naming_the_devices_a_process_has():
    """Two processes of 2 devices each: groups of 2 lie in one process; groups of 4 would make both
    processes' rows one array (each reads its own rows), so the mesh is refused."""
    devices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]
    cluster.check_rows_within_processes(np.array(devices, dtype=object).reshape(2, 2))
    with pytest.raises(ConfigError) as error:
        cluster.make_mesh(devices, "fsdp_tp", 4)
    assert str(error.value) == (
        "tensor_parallel 4 groups devices of processes [0, 1]; each process reads its own rows of the batch, "
        "so a group must lie in one process: pick a divisor of its 2 devices"
    )


def recurrent_config(data_dir, family, mode):
    """configs/<family>_dates.py's model at a tiny size (widths of 16); the captioner on digit strips
    (tests/helpers/tiny.py's TINY_CAPTIONER, its embedding widened to 16)."""
    from configs import base, recurrent

    if family == "captioner":
        from helpers.tiny import TINY_CAPTIONER, captioning_config

        return captioning_config(
            data_dir, sharding=mode, **{f"model.{k}": v for k, v in {**TINY_CAPTIONER, "embed_dim": 16}.items()}
        )
    fields = recurrent.model_fields(family, "dates")
    fields.update(embed_dim=16, hidden_dim=16, attention_dim=16, **({"maxout_dim": 8} if family == "rnnsearch" else {}))
    config = tiny_config(data_dir, sharding=mode)
    config.unlock()
    config.model = base.model(family, **fields)
    config.data.batching = "bucket"
    return config


@pytest.mark.parametrize("family", ["rnnsearch", "lstmn", "captioner"])
def test_the_recurrent_families_and_the_captioner_train_under_fsdp_as_replicated(shared_data_dir, tmp_path, family):
    # the scans compile several times faster on 2 devices than on 8; the rules are the same
    devices = jax.devices()[:2]
    runs = {
        mode: prepare_run(parse(recurrent_config(shared_data_dir, family, mode)), tmp_path, devices=devices)
        for mode in ("replicated", "fsdp")
    }
    # one shape: one compilation per mode (buckets differ in length)
    batches = first_batches(runs["replicated"], count=1) * 2
    (_, reference_losses), (state, losses) = (train_steps(runs[mode], batches) for mode in ("replicated", "fsdp"))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    specs = {name: leaf.sharding.spec for name, leaf in leaves(state["params"]).items()}
    embedding = next(
        name for name in specs if name.endswith("embed.embedding") or name.endswith("embed.embedding.embedding")
    )
    # vocabulary rows whole, the 16 widths split in 2
    assert specs[embedding] == P(None, "data"), specs
    # fsdp: nothing along `model`
    assert all(set(spec) <= {None, "data"} for spec in specs.values()), specs
    # every layer's kernels, not the embedding alone
    assert sum("data" in spec for spec in specs.values()) >= 5, specs


def test_changing_sharding_on_resume_is_allowed_and_logged(shared_data_dir, tmp_path, caplog):
    from run_setup.compatibility import check_resume

    write_run_config(sharded_settings(shared_data_dir, "replicated"), tmp_path)
    with caplog.at_level("INFO"):
        # raises for a changed model field
        check_resume(sharded_settings(shared_data_dir, "fsdp_tp", 2), tmp_path)
    assert "sharding: 'replicated' -> 'fsdp_tp'" in caplog.text and "tensor_parallel: 1 -> 2" in caplog.text
