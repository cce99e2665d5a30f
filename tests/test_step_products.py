"""benchmarks/step_products.py's FLOP count, against hand-worked products."""

from benchmarks import step_products


def test_flop_counts_each_index_once_and_two_per_multiply_add():
    # [2, 3] x [3, 4]: 2 * 4 outputs of 3 multiply-adds
    assert step_products.flop("mk,kn->mn", (2, 3), (3, 4)) == 2 * 2 * 3 * 4
    # the weight gradient contracts the rows: [5, 3]^T x [5, 4]
    assert step_products.flop("mk,mn->kn", (5, 3), (5, 4)) == 2 * 5 * 3 * 4
    # attention's scores: batch and heads once each, then T x S x H
    assert step_products.flop("bnth,bnsh->bnts", (2, 3, 5, 7), (2, 3, 11, 7)) == 2 * 2 * 3 * 5 * 11 * 7


def test_the_step_runs_each_attention_product_on_the_microbatchs_heads_major_shapes():
    attention = [p for p in step_products.PRODUCTS if p[0].startswith("attention")]
    assert [lhs for _, _, lhs, _ in attention] == [(16, 4, 128, 64), (16, 4, 128, 128), (16, 4, 128, 128)]
    assert all(step_products.flop(eq, lhs, rhs) == 2 * 16 * 4 * 128 * 128 * 64 for _, eq, lhs, rhs in attention)
