"""benchmarks/step_profile.py's reading of a compiled program and of a trace."""

import re

import jax
import jax.numpy as jnp

from benchmarks import step_profile


def test_the_products_flop_are_counted_from_the_programs_shapes_and_events_are_matched_by_name():
    def two_products(x, w, v):
        # [8, 16] x [16, 32], then its tanh [8, 32] x [32, 4]
        return jnp.tanh(x @ w) @ v

    args = (jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 4)))
    program = jax.jit(two_products).lower(*args).compile().as_text()
    instructions = step_profile.parse_program(program)
    # what runs (and is traced): the entry computation's instructions, a product's fusion or dot
    entry = program[program.index("\nENTRY ") :]
    running = [instructions[name] for name in re.findall(r"\n\s*(?:ROOT )?%([\w.\-]+) = ", entry)]
    # 2 x output elements x contracted size
    assert sorted(i.flop for i in running if i.flop) == [2 * 8 * 4 * 32, 2 * 8 * 32 * 16]
    assert sum(i.flop for i in running) == 2 * 8 * 4 * 32 + 2 * 8 * 32 * 16
    product = next(i for i in running if i.flop)
    trace = {
        "traceEvents": [
            {"ph": "X", "name": product.name, "dur": 30},
            {"ph": "X", "name": product.name, "dur": 10},
            {"ph": "X", "name": "not an instruction", "dur": 99},
            {"ph": "i", "name": product.name},
        ]
    }
    total, count = step_profile.traced_microseconds(trace, instructions)
    assert (dict(total), dict(count)) == ({product.name: 40}, {product.name: 2})
    assert step_profile.kind(product) == "matrix products, forward"
    tanh = next(i for i in running if "tanh" in i.op_name)
    assert step_profile.kind(tanh) == "tanh"


def test_a_gradients_products_are_told_from_the_forward_ones_by_their_op_name():
    x = jnp.ones((8, 16))

    def loss(w):
        # forward [8, 16] x [16, 32]; backward dW = x^T [16, 8] x g [8, 32], the same FLOP
        return jnp.sum(jnp.tanh(x @ w))

    program = jax.jit(jax.grad(loss)).lower(jnp.ones((16, 32))).compile().as_text()
    instructions = step_profile.parse_program(program)
    entry = program[program.index("\nENTRY ") :]
    running = [instructions[name] for name in re.findall(r"\n\s*(?:ROOT )?%([\w.\-]+) = ", entry)]
    by_kind = {}
    for instruction in running:
        if instruction.flop:
            by_kind.setdefault(step_profile.kind(instruction), []).append(instruction.flop)
    assert by_kind == {"matrix products, forward": [2 * 8 * 32 * 16], "matrix products, backward": [2 * 16 * 32 * 8]}
