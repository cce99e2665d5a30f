"""benchmarks/step_products.py's FLOP count and products, against hand-worked cases and NumPy."""

import numpy as np

from benchmarks import step_products


def test_flop_counts_each_index_once_and_two_per_multiply_add():
    # [2, 3] x [3, 4]: 2 * 4 outputs of 3 multiply-adds
    assert step_products.flop("mk,kn->mn", (2, 3), (3, 4)) == 2 * 2 * 3 * 4
    # the weight gradient contracts the rows: [5, 3]^T x [5, 4]
    assert step_products.flop("mk,mn->kn", (5, 3), (5, 4)) == 2 * 5 * 3 * 4
    # attention's scores: batch and heads once each, then T x S x H
    assert step_products.flop("bnth,bnsh->bnts", (2, 3, 5, 7), (2, 3, 11, 7)) == 2 * 2 * 3 * 5 * 11 * 7


def test_the_step_runs_each_attention_product_on_the_microbatchs_heads_major_shapes():
    attention = [p for p in step_products.products(8) if p[0].startswith("attention")]
    assert [lhs for _, _, lhs, _ in attention] == [(8, 4, 128, 64), (8, 4, 128, 128), (8, 4, 128, 128)]
    assert all(step_products.flop(eq, lhs, rhs) == 2 * 8 * 4 * 128 * 128 * 64 for _, eq, lhs, rhs in attention)


def test_each_swapped_product_is_the_one_before_it_transposed():
    found = step_products.products(8)
    swapped = [i for i, (name, *_) in enumerate(found) if "operands swapped" in name]
    # attention's gradient into the keys, and each Linear's into its weight
    assert len(swapped) == 5
    rng = np.random.default_rng(0)
    for i in swapped:
        (_, original, lhs, rhs), (_, equation, swapped_lhs, swapped_rhs) = found[i - 1], found[i]
        assert (swapped_lhs, swapped_rhs) == (rhs, lhs)
        assert step_products.flop(equation, swapped_lhs, swapped_rhs) == step_products.flop(original, lhs, rhs)
        # the same equations on small operands, a size for each index letter
        sizes = {"b": 2, "n": 3, "t": 4, "s": 5, "h": 6, "m": 7, "k": 8}
        a_letters, b_letters = original.split("->")[0].split(",")
        a = rng.normal(size=[sizes[c] for c in a_letters])
        b = rng.normal(size=[sizes[c] for c in b_letters])
        np.testing.assert_allclose(np.einsum(equation, b, a), np.swapaxes(np.einsum(original, a, b), -1, -2))
