"""NumPy references the tests share (float64, written from the papers' equations)."""

import numpy as np


def np_masked_softmax(scores, mask):
    """float64 softmax over the last axis; masked entries 0, empty rows all 0."""
    scores = np.asarray(scores, np.float64)
    mask = np.broadcast_to(True if mask is None else np.asarray(mask), scores.shape)
    shifted = np.where(mask, scores, -np.inf)
    row_max = np.max(np.where(mask, scores, -np.inf), axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exp = np.where(mask, np.exp(shifted - row_max), 0.0)
    total = exp.sum(-1, keepdims=True)
    weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    # The reference checks itself: rows with something visible are distributions.
    np.testing.assert_allclose(weights.sum(-1)[total[..., 0] > 0], 1.0, rtol=1e-12)
    return weights


def np_softmax(scores):
    """float64 softmax over the last axis."""
    return np_masked_softmax(scores, None)


def np_log_softmax(scores):
    """float64 log-softmax over the last axis."""
    scores = np.asarray(scores, np.float64)
    shifted = scores - scores.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def np_numerical_gradient(function, weights, step=1e-6):
    """Central differences of the scalar `function(weights)` with respect to every entry of the dict
    of float64 arrays `weights`: a dict of the same shapes (truncation error O(step^2))."""
    gradient = {}
    for name, value in weights.items():
        gradient[name] = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            shifted = {**weights, name: value.copy()}
            shifted[name][index] = value[index] + step
            above = function(shifted)
            shifted[name][index] = value[index] - step
            gradient[name][index] = (above - function(shifted)) / (2 * step)
    return gradient


def np_layer_norm(x, scale, bias, epsilon=1e-6):
    """float64 LayerNorm (Ba et al. 2016) over the last axis, the variance in two passes,
    `E[(x - E[x])^2]`, so that no large mean cancels."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)
