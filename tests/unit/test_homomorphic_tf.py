"""The TensorFlow homomorphic ops run the torch binding's kernels: the same block maxima, words
and decoded values, bit for bit, and static output shapes inside tf.function (Horovod's
allreduce and the stats need them)."""
import numpy as np
import pytest
import tensorflow as tf
import torch

from helpers import random_grad, t2n
from hvd_compress.seeds import derive_seed, seed_base
from hvd_compress.tensorflow.ops import lib
from hvd_compress.torch import _C

TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
             "float64": tf.float64}


def to_tf(t: torch.Tensor, dtype: str) -> tf.Tensor:
    # Through float64 the values are exact; the cast back is exact since they came from dtype.
    return tf.cast(tf.constant(t.double().numpy()), TF_DTYPES[dtype])


def signed64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def tf_bits(t) -> bytes:
    return np.asarray(t.numpy()).tobytes()


def torch_bits(t: torch.Tensor) -> bytes:
    return t2n(t).tobytes()


@pytest.mark.parametrize("levels,lane_ranks,block", [(255, 8, 1000), (16, 3, 7), (127, 1, 64)])
@pytest.mark.parametrize("n", [0, 1, 33, 4097])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_tf_ops_and_torch_give_identical_bits(dtype, n, levels, lane_ranks, block):
    x = random_grad(n, dtype, seed=n)
    xt = to_tf(x, dtype)
    base, step = seed_base(3, "layer/w"), 5

    s_tf = lib.hvdc_homo_block_absmax(xt, block=block)
    s = _C.homo_block_absmax(x, block)
    assert tf_bits(s_tf) == torch_bits(s)

    w_tf = lib.hvdc_homo_encode(xt, s_tf, tf.constant(step, tf.int64), block=block, levels=levels,
                                lane_ranks=lane_ranks, seed_base=signed64(base))
    w = _C.homo_encode(x, s, block, levels, lane_ranks, derive_seed(3, "layer/w", step))
    assert w_tf.dtype == tf.int32 and tf_bits(w_tf) == torch_bits(w)

    for summands, alpha in ((1, 1.0), (lane_ranks, -0.25)):
        d_tf = lib.hvdc_homo_decode(w_tf, s_tf, tf.constant(alpha, tf.float64), T=TF_DTYPES[dtype],
                                    n=n, block=block, levels=levels, lane_ranks=lane_ranks,
                                    summands=summands)
        out = torch.empty_like(x)
        _C.homo_decode(w, s, out, block, levels, lane_ranks, summands, alpha, False)
        assert tf_bits(d_tf) == torch_bits(out)


def test_tf_ops_have_static_shapes_in_tf_function():
    @tf.function(input_signature=[tf.TensorSpec([30, 100], tf.float32),
                                  tf.TensorSpec([], tf.int64)])
    def step(x, i):
        s = lib.hvdc_homo_block_absmax(x, block=256)
        w = lib.hvdc_homo_encode(x, s, i, block=256, levels=255, lane_ranks=8, seed_base=7)
        d = lib.hvdc_homo_decode(w, s, tf.constant(1.0, tf.float64), T=tf.float32, n=3000,
                                 block=256, levels=255, lane_ranks=8, summands=8)
        assert s.shape == (12,) and w.shape == (1500,) and d.shape == (3000,)
        return d

    x = tf.constant(random_grad(3000, "float32", seed=1).numpy().reshape(30, 100))
    a = step(x, tf.constant(1, tf.int64))
    b = step(x, tf.constant(2, tf.int64))
    assert a.shape == (3000,) and not np.array_equal(a.numpy(), b.numpy())  # the step seeds


def test_tf_bad_arguments():
    x = tf.ones([10])
    s = lib.hvdc_homo_block_absmax(x, block=4)
    step = tf.constant(0, tf.int64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match=r"needs lanes of w=33 bits"):
        lib.hvdc_homo_encode(x, s, step, block=4, levels=65535, lane_ranks=65538)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match=r"scales must hold 3 element\(s\)"):
        lib.hvdc_homo_encode(x, s[:2], step, block=4, levels=255, lane_ranks=8)
    w = lib.hvdc_homo_encode(x, s, step, block=4, levels=255, lane_ranks=8)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match=r"summands must be in \[1, lane_ranks\] = \[1, 8\], got 9"):
        lib.hvdc_homo_decode(w, s, tf.constant(1.0, tf.float64), T=tf.float32, n=10, block=4,
                             levels=255, lane_ranks=8, summands=9)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match=r"words has 4 element\(s\), 10 elements at levels=255, "
                             r"lane_ranks=8 need 5"):
        lib.hvdc_homo_decode(w[:4], s, tf.constant(1.0, tf.float64), T=tf.float32, n=10,
                             block=4, levels=255, lane_ranks=8, summands=8)
