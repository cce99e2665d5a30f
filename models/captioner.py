"""Show, Attend and Tell (Xu et al. 2015, arXiv:1502.03044v3): an LSTM that captions an image
while attending over a grid of its annotation vectors, with soft (deterministic) or hard
(stochastic) attention.

The encoder turns an image into `L` annotation vectors `a_1 .. a_L` of size D (section 3.1.1):
a small CNN here (a pretrained VGG's conv5_4 grid in the paper), or given feature grids
(`model.inputs = "features"`: a user's pretrained backbone's `[L, D]` output). The decoder
(section 3.1.2) is an LSTM whose step t reads the previous word, the previous hidden state and
a context vector `z_t` (eqs. 1-3):

    [i_t; f_t; o_t; g_t] = [sigma; sigma; sigma; tanh](T [E y_{t-1}; h_{t-1}; z_t])   (1)
    c_t = f_t * c_{t-1} + i_t * g_t,   h_t = o_t * tanh(c_t)                         (2), (3)
    e_ti = f_att(a_i, h_{t-1}) = v^T tanh(W_a a_i + W_h h_{t-1}),  alpha_t = softmax(e_t)  (4), (5)
    z_t = beta_t * phi({a_i}, {alpha_ti}),   beta_t = sigma(f_beta(h_{t-1}))        (6), section 4.2.1
    h_0 = tanh(f_init_h(mean_i a_i)),   c_0 = tanh(f_init_c(mean_i a_i))              section 3.1.2
    p(y_t | a, y_<t) ~ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))                        (7)

- soft attention (section 4.2): `phi = sum_i alpha_ti a_i`, the expectation of the context; trained
  by likelihood plus the doubly stochastic penalty `lambda sum_i (1 - sum_t alpha_ti)^2` (section 4.2.1);
- hard attention (section 4.1): a location `s_t ~ Multinoulli(alpha_t)` and `phi = a_{s_t}` (eqs. 8-9),
  trained with the paper's final learning rule of section 4.1 (after eq. 12; see `Captioner.objective`).

Choices where the paper leaves room, and why:
- f_init_h, f_init_c and f_beta are single dense layers (the paper says MLPs; the authors' code,
  arctic-captions, uses one layer with tanh for the initial states, as here).
- At decode time hard attention uses the expectation `sum_i alpha_ti a_i`, not the most likely
  location: decoding is then deterministic (beam search scores are well defined), it is the
  context half of the training images see (the paper's trick of setting `s` to its expectation
  with probability 0.5).
- The CNN sees each pixel's coordinates as two extra input channels (`model.coordinates`, as
  CoordConv, Liu et al. 2018): a small CNN trained from scratch has no other way to tell the
  decoder where an annotation lies, which captions that read left to right need.
- Each conv layer's responses are centred over the image (their mean over positions subtracted
  before the ReLU; instance normalisation without the scale) and the kernels start as He et al.
  (2015) prescribe. A from-scratch CNN on mostly blank strips otherwise hands the decoder
  annotations that are nearly the same everywhere, and the first, near-uniform attention reads
  their mean, which carries almost nothing of the digits (a classifier on the mean annotation
  learns nothing in 300 steps without the centring and reaches 92% accuracy with it: an
  observation on digit_strips; see docs/performance.md).
- The deep output is linear in its three terms, as eq. 7 writes it (a tanh there stalls learning:
  an observation on digit_strips; see docs/performance.md).
- The gating scalar beta (`model.selector`) is off by default, unlike the paper: on features a CNN
  learns from scratch it closes before the features mean anything (on single digits beta falls
  to 0.003 within 400 steps and the decoder never reads the image: an observation on
  digit_strips; see docs/performance.md). With a pretrained backbone's features, as in the paper,
  the context is informative from the first step: turn it on there.
- The doubly stochastic penalty is off by default (`model.doubly_stochastic = 0`), unlike the
  paper's soft attention: on digit_strips it lowers soft attention's localisation accuracy from
  0.998 to 0.921, and hard attention, for which the paper does not define it, stalls with it
  (0.435 exact caption match against 0.958): `benchmarks/captioning_comparison.py`, docs/performance.md.

Axes: B batch, H x W image (C channels), L = h x w annotation grid, D annotation size, T caption
length, E embedding (the paper's m), N hidden (the paper's n), A attention, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import Attention, AttentionRole
from models.interface import ModelConfig
from models.layers import Dropout, Linear, check_dropout, logical, shift_right
from models.rnn import LSTMCell, LSTMState, time_major
from utils.errors import ConfigError

Array = jax.Array
ATTENTIONS = ("soft", "hard")
INPUTS = ("pixels", "features")


@dataclasses.dataclass(frozen=True)
class CaptionerConfig(ModelConfig):
    """Hyperparameters; the defaults are our choice for small images on a CPU (the paper's
    sizes: a 14x14x512 VGG grid, 512 embedding, 1800 hidden units for Flickr8k...) and what
    `configs/captioner_*` train; where they depart from the paper, the module docstring says why."""

    # f_att, each word over the image's annotation cells
    roles = frozenset({AttentionRole.CROSS})
    # `Captioner.objective`: the doubly stochastic penalty, hard attention's estimator
    has_objective = True

    # caption vocabulary
    vocab_size: int
    # unused: the inputs are images (kept for the common interface)
    source_vocab_size: int | None = None
    # "soft" (section 4.2) or "hard" (section 4.1)
    attention: str = "soft"
    # "pixels": images through the CNN; "features": given [L, D] annotation grids
    inputs: str = "pixels"
    # image channels (pixels)
    channels: int = 1
    # D of given feature grids (features)
    feature_dim: int = 0
    # 3x3 conv + ReLU layers of the CNN
    conv_widths: tuple[int, ...] = (32, 64, 64, 64)
    # 2x2 max pools, after each of the first `pools` conv layers: the grid is (H, W) / 2^pools
    pools: int = 2
    # the pixels' (x, y) as two more input channels
    coordinates: bool = True
    # E (the paper's m)
    embed_dim: int = 64
    # N (the paper's n)
    hidden_dim: int = 256
    # A of f_att
    attention_dim: int = 128
    # the gating scalar beta_t (section 4.2.1); off, unlike the paper (see the module docstring)
    selector: bool = False
    # lambda of the penalty of section 4.2.1; 0 (off), unlike the paper (see the module docstring)
    doubly_stochastic: float = 0.0
    # lambda_r of section 4.1's final learning rule (hard attention)
    reinforce_weight: float = 1.0
    # lambda_e of the same rule (hard attention)
    entropy_weight: float = 0.01
    # b_k = decay b_{k-1} + (1 - decay) log p(y | s_k, a) (section 4.1)
    baseline_decay: float = 0.9
    # hard attention: per image, s is set to its expectation alpha (see objective)
    expectation_probability: float = 0.5
    # on the deep output's input, in [0, 1)
    dropout_rate: float = 0.0
    # how dropout masks are drawn: "packed" or "bernoulli" (models/layers.py, `DROPOUT_MASKS`)
    dropout_masks: str = "packed"
    bos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"model.attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.inputs not in INPUTS:
            raise ConfigError(f"model.inputs must be one of {', '.join(INPUTS)}, got {self.inputs!r}")
        if self.inputs == "features" and self.feature_dim < 1:
            raise ConfigError("model.inputs = 'features' needs model.feature_dim, the size of a given annotation")
        if self.inputs == "pixels" and (not self.conv_widths or min(self.conv_widths) < 1 or self.channels < 1):
            raise ConfigError(
                f"model.conv_widths must be positive widths and model.channels positive, got "
                f"{self.conv_widths}, {self.channels}"
            )
        if not 0 <= self.pools <= len(self.conv_widths):
            raise ConfigError(f"model.pools must be between 0 and len(model.conv_widths), got {self.pools}")
        for name in ("embed_dim", "hidden_dim", "attention_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("doubly_stochastic", "reinforce_weight", "entropy_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be non-negative, got {getattr(self, name)}")
        for name in ("baseline_decay", "expectation_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1], got {getattr(self, name)}")
        check_dropout(self, "dropout_rate")

    @property
    def reads(self) -> str:
        """Images ("pixels", through the CNN) or given annotation grids ("features"): `inputs`."""
        return self.inputs

    @property
    def annotation_dim(self) -> int:
        return self.feature_dim if self.inputs == "features" else self.conv_widths[-1]


class CaptionMemory(NamedTuple):
    """The encoded image: its annotations and their attention keys."""

    # a_i [B, L, D]
    annotations: Array
    # W_a a_i [B, L, A], once per image
    keys: Array
    mask: Array  # [B, L] bool, all True (every cell is real)


class CaptionState(NamedTuple):
    lstm: LSTMState  # (h_t, c_t) [B, N] each


class Captioner(nnx.Module):
    """The Show-Attend-and-Tell captioner behind the common model interface; `inputs` are images
    `[B, H, W, C]` (uint8 0..255 or float 0..1) or feature grids `[B, L, D]`."""

    def __init__(self, config: CaptionerConfig, *, rngs: nnx.Rngs):
        self.config = config
        E, N, D = config.embed_dim, config.hidden_dim, config.annotation_dim
        if config.inputs == "pixels":
            widths = (config.channels + 2 * config.coordinates, *config.conv_widths)
            # keeps the responses' scale through the ReLUs (He et al. 2015)
            he = nnx.initializers.kaiming_normal()
            self.convs = nnx.List(
                nnx.Conv(
                    a,
                    b,
                    (3, 3),
                    padding="SAME",
                    # no bias: the centring would cancel it
                    use_bias=False,
                    kernel_init=he,
                    kernel_metadata=logical(None, None, "embed", "mlp"),
                    rngs=rngs,
                )
                for a, b in zip(widths, widths[1:])
            )
        else:
            self.convs = nnx.List([])
        # E
        self.embed = nnx.Embed(
            config.vocab_size,
            E,
            embedding_init=nnx.initializers.normal(0.1),
            embedding_metadata=logical("vocab", "embed"),
            rngs=rngs,
        )
        # f_init_h
        self.init_hidden = Linear(D, N, rngs=rngs)
        # f_init_c
        self.init_cell = Linear(D, N, rngs=rngs)
        # f_att
        self.attention = Attention(
            N, D, score="additive", attention_dim=config.attention_dim, role=AttentionRole.CROSS, rngs=rngs
        )
        # f_beta
        self.beta = nnx.data(Linear(N, 1, rngs=rngs) if config.selector else None)
        # T of eq. 1 over [E y_{t-1}; z_t] (and h_{t-1} inside)
        self.lstm = LSTMCell(E + D, N, rngs=rngs)
        # L_h
        self.output_hidden = Linear(N, E, rngs=rngs)
        # L_z
        self.output_context = Linear(D, E, use_bias=False, rngs=rngs)
        # L_o
        self.output = Linear(E, config.vocab_size, axes=("embed", "vocab"), rngs=rngs)
        self.dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)

    # -- the encoder -------------------------------------------------------------

    def annotations(self, inputs: Array) -> Array:
        """Section 3.1.1: `inputs` -> the annotation grid `[B, L, D]` (row-major over the h x w grid)."""
        if self.config.inputs == "features":
            if inputs.ndim != 3 or inputs.shape[-1] != self.config.feature_dim:
                raise ConfigError(
                    f"feature grids must be [B, L, model.feature_dim={self.config.feature_dim}], got {inputs.shape}"
                )
            return inputs.astype(jnp.float32)
        if inputs.ndim != 4 or inputs.shape[-1] != self.config.channels:
            raise ConfigError(f"images must be [B, H, W, model.channels={self.config.channels}], got {inputs.shape}")
        x = inputs.astype(jnp.float32)
        if jnp.issubdtype(inputs.dtype, jnp.integer):
            x = x / 255.0
        if self.config.coordinates:
            batch, height, width, _ = x.shape
            ys, xs = jnp.meshgrid(jnp.linspace(-1, 1, height), jnp.linspace(-1, 1, width), indexing="ij")
            x = jnp.concatenate([x, jnp.broadcast_to(jnp.stack([xs, ys], -1), (batch, height, width, 2))], axis=-1)
        for index, conv in enumerate(self.convs):
            response = conv(x)
            # centred over the image
            x = jax.nn.relu(response - response.mean(axis=(1, 2), keepdims=True))
            if index < self.config.pools:
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def grid_shape(self, height: int, width: int) -> tuple[int, int]:
        """The annotation grid `(h, w)` of an `H x W` image (pixels)."""
        scale = 2**self.config.pools
        return height // scale, width // scale

    def cell_centres(self, height: int, width: int) -> np.ndarray:
        """`[L, 2]` pixel coordinates `(x, y)` of each annotation cell's centre, in the grid's order: cell
        (r, c) covers the 2^pools pixels from (r, c) * 2^pools (a remainder past the last cell is dropped)."""
        rows, columns = self.grid_shape(height, width)
        scale = 2**self.config.pools
        ys, xs = np.meshgrid((np.arange(rows) + 0.5) * scale, (np.arange(columns) + 0.5) * scale, indexing="ij")
        return np.stack([xs.ravel(), ys.ravel()], -1)

    # -- the model interface -------------------------------------------------------

    def encode(self, inputs: Array) -> CaptionMemory:
        annotations = self.annotations(inputs)
        mask = jnp.ones(annotations.shape[:2], bool)
        return CaptionMemory(annotations, self.attention.project_keys(annotations), mask)

    def init_decode_state(self, memory: CaptionMemory, batch_size: int, max_len: int) -> CaptionState:
        """h_0, c_0 from the mean annotation (section 3.1.2)."""
        del batch_size, max_len
        mean = memory.annotations.mean(axis=1)
        return CaptionState(LSTMState(jnp.tanh(self.init_hidden(mean)), jnp.tanh(self.init_cell(mean))))

    def _attend(self, memory: CaptionMemory, hidden: Array) -> tuple[Array, Array, Array]:
        """Eqs. 4-6 before phi: `(alpha_t [B, L], sum_i alpha_ti a_i [B, D], beta_t [B, 1])` from h_{t-1}."""
        expected, weights = self.attention(hidden, memory.keys, memory.annotations, memory.mask)
        beta = jax.nn.sigmoid(self.beta(hidden)) if self.beta is not None else jnp.ones((hidden.shape[0], 1))
        return weights, expected, beta

    def _advance(
        self, embedded: Array, context: Array, state: CaptionState, mask: Array | None = None
    ) -> tuple[Array, CaptionState]:
        """Eqs. 1-3 and 7 from `E y_{t-1} [B, E]` and `z_t [B, D]`: `(logits [B, V], state)`; `mask [B, E]`:
        dropout on the deep output's input (drawn before the scan, as NNX's RNG cannot be used inside it)."""
        lstm = self.lstm(self.lstm.project(jnp.concatenate([embedded, context], axis=-1)), state.lstm)
        # eq. 7's sum
        deep = embedded + self.output_hidden(lstm.hidden) + self.output_context(context)
        if mask is not None:
            deep = deep * mask
        logits = self.output(deep)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), CaptionState(lstm)

    def decode_step(self, memory: CaptionMemory, token: Array, state: CaptionState) -> tuple[Array, CaptionState]:
        """Next-word logits from `token [B]` (the previous word, bos first); hard attention decodes
        with the expected context (see the module docstring)."""
        weights, expected, beta = self._attend(memory, state.lstm.hidden)
        return self._advance(self.embed(token), beta * expected, state)

    def teacher_forced(
        self,
        batch: dict[str, Array],
        *,
        deterministic: bool = True,
        key: Array | None = None,
        locations: Array | None = None,
        expectation: Array | bool = False,
    ) -> dict[str, Array]:
        """A pass over the reference captions, with the expected context (soft attention, and hard
        attention's decoding), or hard attention's `z_t = a_{s_t}` (eq. 9) at locations sampled
        `s_t ~ alpha_t` with `key`, or given `locations [B, T]` (for tests). `expectation`, a bool per
        row `[B]` (or one for all), switches those rows of a sampling pass to the expected context
        (the 0.5 trick of section 4.1).

        Returns `logits [B, T, V]`, `weights` alpha `[B, T, L]`, `locations [B, T]` (the sampled or
        given ones; the most attended without either).
        """
        targets = batch["targets"]
        memory = self.encode(batch["inputs"])
        embedded = self.embed(shift_right(targets, self.config.bos_id))
        steps = targets.shape[1]
        hard = key is not None or locations is not None
        given = locations if locations is not None else jnp.zeros(targets.shape, jnp.int32)
        keys = jax.random.split(key, steps) if key is not None else jnp.zeros(steps)
        masks = None
        if not deterministic and self.config.dropout_rate > 0:
            masks = time_major(self.dropout(jnp.ones(embedded.shape), deterministic=False))  # [T, B, E]

        def step(state, inputs):
            embedded_t, given_t, key_t, mask_t = inputs
            weights, expected, beta = self._attend(memory, state.lstm.hidden)
            if key is not None:
                chosen = jax.random.categorical(key_t, jnp.log(jnp.maximum(weights, 1e-30)))
            elif locations is not None:
                chosen = given_t
            else:
                chosen = jnp.argmax(weights, axis=-1)
            context = expected
            # phi = a_{s_t}
            if hard:
                sampled = jnp.take_along_axis(memory.annotations, chosen[:, None, None], axis=1)[:, 0]
                context = jnp.where(jnp.reshape(expectation, (-1, 1)), expected, sampled)
            logits, state = self._advance(embedded_t, beta * context, state, mask_t)
            return state, (logits, weights, chosen)

        start = self.init_decode_state(memory, targets.shape[0], steps)
        _, outputs = jax.lax.scan(step, start, (time_major(embedded), time_major(given), keys, masks))
        logits, weights, chosen = time_major(outputs)
        self.attention.record(weights)
        return {"logits": logits, "weights": weights, "locations": chosen}

    def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
        """Teacher-forced logits `[B, T, V]` with the expected context (both attentions)."""
        return self.teacher_forced(batch, deterministic=deterministic)["logits"]

    # -- training ----------------------------------------------------------------

    def initial_model_state(self) -> dict[str, Array]:
        """State the train step carries besides the parameters: hard attention's moving-average
        baseline b of eq. 12 (checkpointed with them, so a resume continues it exactly)."""
        return {"baseline": jnp.zeros((), jnp.float32)} if self.config.attention == "hard" else {}

    def objective(self, batch: dict[str, Array], model_state: dict, key: Array, token_sums) -> tuple[Array, dict, dict]:
        """The summed loss to minimise, the token sums, and the next model state.

        `token_sums(logits, targets)` is the trainer's likelihood (label smoothing included).
        Soft attention: the smoothed negative log-likelihood plus the doubly stochastic penalty
        (applied to hard attention too when its lambda is not 0: the paper defines it for soft
        attention only; `benchmarks/captioning_comparison.py` measures both).
        Hard attention, section 4.1's final learning rule: with probability
        `expectation_probability` per image (as the paper says; drawn per batch instead, the
        optimizer alternates between soft and REINFORCE steps) the expected context, trained as
        soft attention;
        otherwise, with a sampled `s`, minus the surrogate whose gradient is the rule's estimate:

            log p(y | s, a) + lambda_r * [log p(y | s, a) - b] log p(s | a) + lambda_e * H[alpha]

        with `[...]` held constant; then `b <- decay * b + (1 - decay) * mean log p(y | s, a)` over the
        batch's captions (those on the expected context included: b only shifts the estimate's
        variance, not its mean).
        """
        config = self.config
        targets = batch["targets"]
        real = (targets != config.pad_id).astype(jnp.float32)  # [B, T]
        expectation_key, sample_key = jax.random.split(key)
        hard = config.attention == "hard"
        if hard:
            # [B]
            use_expectation = jax.random.bernoulli(expectation_key, config.expectation_probability, targets.shape[:1])
            outputs = self.teacher_forced(batch, deterministic=False, key=sample_key, expectation=use_expectation)
        else:
            outputs = self.teacher_forced(batch, deterministic=False)
        sums = token_sums(outputs["logits"], targets)
        loss = sums["smoothed_loss_sum"]
        penalty = doubly_stochastic_penalty(outputs["weights"], real)  # [B]
        loss = loss + config.doubly_stochastic * penalty.sum()
        sums = {**sums, "doubly_stochastic_sum": penalty.sum()}
        new_state = model_state
        if hard:
            terms = hard_attention_terms(outputs["logits"], outputs["weights"], outputs["locations"], targets, real)
            reward = jax.lax.stop_gradient(terms["log_likelihood"] - model_state["baseline"])  # [B]
            surrogate = (
                config.reinforce_weight * reward * terms["log_locations"] + config.entropy_weight * terms["entropy"]
            )
            loss = loss - jnp.where(use_expectation, 0.0, surrogate).sum()
            mean_likelihood = jax.lax.stop_gradient(terms["log_likelihood"].mean())
            new_state = {
                "baseline": config.baseline_decay * model_state["baseline"]
                + (1 - config.baseline_decay) * mean_likelihood
            }
        return loss, sums, new_state


def doubly_stochastic_penalty(weights: Array, real: Array) -> Array:
    """The doubly stochastic penalty `sum_i (1 - sum_t alpha_ti)^2` (section 4.2.1) per caption, over its real steps:
    `weights [B, T, L]`, `real [B, T]` -> `[B]`."""
    totals = jnp.einsum("BTL,BT->BL", weights, real)
    return jnp.sum((1.0 - totals) ** 2, axis=-1)


def hard_attention_terms(
    logits: Array, weights: Array, locations: Array, targets: Array, real: Array
) -> dict[str, Array]:
    """Per caption `[B]`: `log_likelihood` log p(y | s, a), `log_locations` log p(s | a) =
    sum_t log alpha_{t, s_t}, `entropy` sum_t H[alpha_t]; each over the caption's real steps."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
    log_weights = jnp.log(jnp.maximum(weights, 1e-30))
    chosen = jnp.take_along_axis(log_weights, locations[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(weights * log_weights, axis=-1)
    return {
        name: jnp.sum(value * real, axis=-1)
        for name, value in (("log_likelihood", picked), ("log_locations", chosen), ("entropy", entropy))
    }
