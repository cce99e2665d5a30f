"""Every registered family against the model interface (models/interface.py): it is an
`EncoderDecoder` whose methods take the interface's arguments and give its shapes, and what its
`ModelConfig` declares (reads, roles, has_objective, has_decode, length_limit, ...) is what it does.
Tiny sizes, traced with `jax.eval_shape` (shapes and structure, nothing compiled or run); and a
family that breaks the interface fails the check."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from models.attention import AttentionWeights, attention_roles
from models.interface import READS, EncoderDecoder, ImageGrid, ModelConfig, OwnObjective, TeacherForcedDecoder
from models.transformer import Transformer, TransformerConfig
from run_setup.sharding import LOGICAL_AXES
from scoring import metrics
from utils.errors import ConfigError

# batch, source length, target length, target vocabulary
B, S, T, V = 2, 5, 4, 11
BOS, PAD = 1, 0
# height, width of the pixel inputs
IMAGE = (8, 8)
# cells of the feature-grid inputs
GRID = 6

# Every registered family, tiny: one variant per value a declaration can take with the hyperparameters.
TINY = {
    "transformer": [
        dict(d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1, num_decoder_layers=1),
        dict(
            d_model=8,
            num_heads=2,
            d_ff=16,
            num_encoder_layers=1,
            num_decoder_layers=1,
            positional="learned",
            max_length=8,
            share_embeddings=False,
            source_vocab_size=9,
        ),
    ],
    "rnnencdec": [dict(embed_dim=4, hidden_dim=6, maxout_dim=3)],
    "rnnsearch": [dict(embed_dim=4, hidden_dim=6, maxout_dim=3, attention_dim=5)],
    "luong": [dict(embed_dim=4, hidden_dim=6, num_encoder_layers=1, num_decoder_layers=1, attention_dim=5)],
    "lstmn": [dict(embed_dim=4, hidden_dim=6, attention_dim=5, max_length=8)],
    "captioner": [
        dict(embed_dim=4, hidden_dim=6, attention_dim=5, conv_widths=(4,), pools=1),
        dict(embed_dim=4, hidden_dim=6, attention_dim=5, inputs="features", feature_dim=3, attention="hard"),
    ],
}

VARIANTS = [
    pytest.param(name, fields, id=f"{name}-{index}")
    for name in sorted(models.MODELS)
    for index, fields in enumerate(TINY.get(name, []))
]


def build(name: str, **fields):
    """The family `name` with these hyperparameters, abstract (parameters as shapes: nothing is run)."""
    return nnx.eval_shape(
        lambda: models.create_model(
            name, rngs=nnx.Rngs(params=0, dropout=1), vocab_size=V, bos_id=BOS, pad_id=PAD, **fields
        )
    )


def traced(model, method, *arrays):
    """The shapes of `method(model, *arrays)`, traced, not run (no compilation: the test stays fast;
    the families' own tests check the values, e.g. cached decoding against the forward pass)."""
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda state, arrays: method(nnx.merge(graphdef, state), *arrays), state, arrays)


def inputs_for(config: ModelConfig, length: int = S) -> jax.ShapeDtypeStruct:
    """A batch of what `config.reads` says the model reads."""
    if config.reads == "tokens":
        return jax.ShapeDtypeStruct((B, length), jnp.int32)
    if config.reads == "pixels":
        return jax.ShapeDtypeStruct((B, *IMAGE, config.channels), jnp.uint8)
    return jax.ShapeDtypeStruct((B, GRID, config.feature_dim), jnp.float32)


def positional_names(function) -> list[str]:
    return [
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]


def shapes(tree) -> list:
    return [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(tree)]


def check_family(model) -> None:
    """Asserts that `model` implements the interface and does what its config declares."""
    missing = [
        a
        for a in ("config", "__call__", "encode", "init_decode_state", "decode_step")
        if getattr(model, a, None) is None
    ]
    assert isinstance(model, EncoderDecoder), f"{type(model).__name__} lacks {missing}"
    config = model.config
    assert isinstance(config, ModelConfig), f"{type(config).__name__} is not a models.interface.ModelConfig"
    for method in ("__call__", "encode", "init_decode_state", "decode_step"):
        wanted, got = positional_names(getattr(EncoderDecoder, method)), positional_names(getattr(type(model), method))
        assert got[: len(wanted)] == wanted, f"{type(model).__name__}.{method} takes {got}, the interface {wanted}"

    # Declared capabilities, both ways: what is declared is there, and what is there is declared.
    assert config.reads in READS, f"reads = {config.reads!r}, not one of {READS}"
    assert isinstance(model, OwnObjective) == config.has_objective, f"has_objective = {config.has_objective}"
    assert isinstance(model, TeacherForcedDecoder) == config.has_decode, f"has_decode = {config.has_decode}"
    if config.reads == "pixels":
        assert isinstance(model, ImageGrid), "reads pixels, but has no grid_shape and cell_centres"
    limit = config.length_limit
    assert limit is None or (isinstance(limit, int) and limit >= 1), f"length_limit = {limit!r}"
    assert isinstance(config.tape_bytes(B, S), int) and config.tape_bytes(B, S) >= 0
    assert isinstance(config.needs_shared_vocabulary, bool)
    if config.needs_shared_vocabulary:
        with pytest.raises(ConfigError):
            dataclasses.replace(config, source_vocab_size=config.vocab_size + 1)

    # The interface's shapes.
    batch = {"inputs": inputs_for(config), "targets": jax.ShapeDtypeStruct((B, T), jnp.int32)}
    logits, weights = traced(model, lambda m, batch: nnx.capture(m, AttentionWeights)(batch, deterministic=True), batch)
    assert logits.shape == (B, T, V), f"__call__ gave {logits.shape}, not [B, T, V] = {(B, T, V)}"
    memory = traced(model, lambda m, inputs: m.encode(inputs), batch["inputs"])
    state = traced(model, lambda m, memory: m.init_decode_state(memory, B, T), memory)
    token = jax.ShapeDtypeStruct((B,), jnp.int32)
    step_logits, next_state = traced(model, lambda m, *args: m.decode_step(*args), memory, token, state)
    assert step_logits.shape == (B, V), f"decode_step gave logits {step_logits.shape}, not [B, V] = {(B, V)}"
    assert jax.tree.structure(next_state) == jax.tree.structure(state) and shapes(next_state) == shapes(state), (
        "decode_step's state differs in structure or shapes from init_decode_state's"
    )

    # Roles: every attention module has one, records its weights, and the config lists them all.
    recorded = {"/".join(map(str, path[:-1])): variable.get_value()[0] for path, variable in nnx.to_flat_state(weights)}
    roles = attention_roles(model)
    assert set(recorded) == set(roles), f"modules that record {sorted(recorded)}, modules with a role {sorted(roles)}"
    assert set(roles.values()) == config.roles, f"roles declared {set(config.roles)}, found {set(roles.values())}"

    if config.reads == "pixels":
        rows, columns = model.grid_shape(*IMAGE)
        (cells,) = {w.shape[-1] for w in recorded.values()}
        assert rows * columns == cells, f"grid_shape {rows}x{columns}, but the attention reads {cells} cells"
        assert model.cell_centres(*IMAGE).shape == (cells, 2)
    if config.has_decode:
        assert traced(model, lambda m, *args: m.decode(*args), batch["targets"], memory).shape == (B, T, V)
    if config.has_objective:
        model_state = model.initial_model_state()
        assert isinstance(model_state, dict)
        loss, sums, new_state = traced(
            model, lambda m, *args: m.objective(*args, metrics.token_sums), batch, model_state, jax.random.key(0)
        )
        assert loss.shape == () and "smoothed_loss_sum" in sums
        assert jax.tree.structure(new_state) == jax.tree.structure(model_state), (
            "objective changes the model state's structure"
        )
    # the model takes a source as long as its limit
    if limit is not None:
        traced(model, lambda m, inputs: m.encode(inputs), inputs_for(config, limit))


def test_every_registered_family_has_tiny_sizes():
    assert set(TINY) == set(models.MODELS), "add the new family's tiny sizes to TINY"


@pytest.mark.parametrize("name, fields", VARIANTS)
def test_family_implements_the_interface(name, fields):
    check_family(build(name, **fields))


@pytest.mark.parametrize("name, fields", VARIANTS)
def test_every_parameter_names_each_of_its_axes(name, fields):
    """Sharding follows the names (run_setup/sharding.py's rule table): a parameter without them would
    stay replicated under every mode, unnoticed."""
    params = [
        (path, variable) for path, variable in nnx.iter_graph(build(name, **fields)) if isinstance(variable, nnx.Param)
    ]
    assert params
    for path, variable in params:
        axes = getattr(variable, "out_sharding", None)
        assert axes is not None and len(axes) == len(variable.shape), (path, variable.shape, axes)
        assert set(axes) <= {*LOGICAL_AXES, None}, (path, axes)


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_what_a_family_says_of_saved_configs_names_its_fields_and_values(name):
    """`fields_before` and `renamed_values` name real fields; the values a saved run is read with are
    valid, and each old name is not (else a misspelt field or value would silently do nothing)."""
    config_class = models.MODELS[name][0]
    fields = models.fields_of(name)
    for field, value in config_class.fields_before.items():
        assert field in fields, f"{name}.fields_before names {field!r}, not a field"
        models.checked_config(name, **{field: value})
    for field, renames in config_class.renamed_values.items():
        assert field in fields, f"{name}.renamed_values names {field!r}, not a field"
        for old, new in renames.items():
            models.checked_config(name, **{field: new})
            with pytest.raises(ConfigError):
                models.checked_config(name, **{field: old})


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_source_kind_follows_the_declaration(name):
    for fields in TINY[name]:
        fields = {k: v for k, v in fields.items() if k not in models.FROM_VOCABULARY}
        kind = models.source_kind_of(name, fields)
        assert kind == models.SOURCE_KINDS[models.checked_config(name, **fields).reads]


class NoDecodeStep(Transformer):
    # a family that forgot its decoding step
    decode_step = None


@dataclasses.dataclass(frozen=True)
class ClaimsObjective(TransformerConfig):
    # declared, but the Transformer has no `objective`
    has_objective = True


@pytest.mark.parametrize(
    "broken, complaint",
    [
        (lambda: NoDecodeStep(TransformerConfig(V, **TINY["transformer"][0]), rngs=nnx.Rngs(0)), "decode_step"),
        (lambda: Transformer(ClaimsObjective(V, **TINY["transformer"][0]), rngs=nnx.Rngs(0)), "has_objective"),
    ],
)
def test_a_family_that_breaks_the_interface_fails(broken, complaint):
    with pytest.raises(AssertionError, match=complaint):
        check_family(nnx.eval_shape(broken))
