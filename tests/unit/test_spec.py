"""Spec parsing, the registry, and the core's independence from any framework."""
import subprocess
import sys

import pytest

import hvd_compress as hc


def test_string_and_dict_parse_to_the_same_config():
    a = hc.parse_spec("topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.9")
    b = hc.parse_spec({"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov",
                       "mu": 0.9})
    assert a == b and hash(a) == hash(b)
    assert a.codec == "topk" and a.param_dict == {"k": 0.01}
    assert a.ef == "vanilla" and a.momentum == "nesterov" and a.mu == 0.9


def test_byteps_keys():
    cfg = hc.parse_spec({"compressor": "onebit", "scaling": "false", "ef": "vanilla", "seed": 3})
    assert cfg.param_dict == {"scaling": False} and cfg.seed == 3
    cfg = hc.parse_spec({"codec": "randomk", "k": 100})
    assert cfg.param_dict["k"] == 100


def test_k_is_a_fraction_below_one_and_a_count_from_one():
    info = hc.get_codec("topk")
    assert info.kept({"k": 0.01}, 1000) == 10
    assert info.kept({"k": 0.0001}, 1000) == 1
    assert info.kept({"k": 50}, 1000) == 50
    assert info.kept({"k": 5000}, 1000) == 1000
    assert info.kept({"k": 0.5}, 0) == 0


def test_defaults_filled_and_canonical_round_trip():
    cfg = hc.parse_spec("onebit")
    assert cfg.param_dict == {"scaling": True}
    assert hc.parse_spec(cfg.canonical()) == cfg
    assert hc.parse_spec(None).codec == "none"
    assert hc.parse_spec("efsignsgd").ef == "vanilla"


@pytest.mark.parametrize("spec,message", [
    ("gzip", "unknown codec 'gzip'; valid codecs: none, fp16, bf16, onebit"),
    ("topk,ratio=0.1", "codec 'topk' has no parameter 'ratio'; valid: k ("),
    ("topk,k=-1", "topk: k must be a fraction in (0, 1) or an integer count >= 1, got -1.0"),
    ("topk,k=2.5", "topk: k must be a fraction in (0, 1) or an integer count >= 1, got 2.5"),
    ("topk,k=abc", "topk: k must be a number, got 'abc'"),
    ("topk,k", "spec item 'k' has no value"),
    ("topk,k=", "needs both a name and a value"),
    ("topk,k=0.1,k=0.2", "given twice"),
    ("", "empty compression spec"),
    ("onebit,scaling=maybe", "onebit: scaling must be true or false, got 'maybe'"),
    ("onebit,ef=fancy", "ef='fancy' is not valid; valid: none, vanilla"),
    ("onebit,momentum=adam", "momentum='adam' is not valid; valid: none, nesterov"),
    ("onebit,mu=0.5", "mu is the momentum factor of momentum=nesterov"),
    ("onebit,momentum=nesterov,mu=1.5", "mu must be in [0, 1), got 1.5"),
    ("efsignsgd,ef=none", "efsignsgd has error feedback built in"),
    ("randomk,seed=-4", "seed must be in [0, 2^63)"),
    ("dithering,partition=log", "dithering: partition must be linear or natural, got 'log'"),
    ("dithering,s=0", "dithering: s must be an integer in [1, 127], got 0"),
    ("dithering,normalize=clipped", "dithering: normalize must be max or l2"),
    ("qsgd,partition=natural", "codec 'qsgd' has no parameter 'partition'"),
    ("terngrad,clip=0", "terngrad: clip must be a number > 0"),
    ("dgc,momentum=nesterov", "dgc with momentum=nesterov is refused: DGC corrects momentum "
                              "itself"),
    ("dgc,ef=none", "dgc has error feedback built in (it keeps what it did not send)"),
    ("dgc,warmup_steps=1.5", "dgc: warmup_steps must be an integer, got '1.5'"),
    ("powersgd,ef=vanilla", "powersgd with ef=vanilla is refused: PowerSGD keeps its own"),
    ("powersgd,rank=0", "powersgd: rank must be an integer >= 1, got 0"),
    ("threshold,threshold=-1", "threshold: threshold must be a number >= 0, got -1.0"),
    ("randomk,rescale=true,ef=vanilla", "randomk with rescale=true,ef=vanilla is refused: error "
                                        "feedback would"),
    ("onebit,bucket_mb=-2", "bucket_mb must be a number of MiB >= 0 (0: no buckets), got -2.0"),
    ("onebit,bucket_mb=big", "bucket_mb must be a number, got 'big'"),
    ("onebit,autotune=-1", "autotune must be a number of probe steps per arm >= 0 (0: always "
                           "compress), got -1"),
    ("onebit,autotune=2.5", "autotune must be an integer, got '2.5'"),
    ("none,autotune=3", "codec none compresses nothing: drop autotune or name a codec"),
    ("fp16,granularity=tensor", "granularity=tensor encodes each member of a bucket as if it "
                                "travelled alone, in one allgather; fp16 travels by allreduce: "
                                "valid for onebit, signsgd, efsignsgd, topk, minmax8, dithering, "
                                "qsgd, terngrad, natural, threshold, dgc"),
    ("bf16,granularity=tensor", "bf16 encodes each element on its own, the same either way"),
    ("powersgd,granularity=tensor", "powersgd batches its matrices itself"),
    ("topk,granularity=layer", "granularity='layer' is not valid; valid: bucket, tensor"),
    ("topk,granularity=tensor,collective=allreduce", "granularity=tensor sends a bucket's "
                                                     "members as one allgather: collective="),
    ({"k": 0.1}, "names no codec"),
    ({"compressor": "topk", "codec": "topk"}, "not both"),
    (42, "must be a string, a dict or a CompressionConfig, got int"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError) as err:
        hc.parse_spec(spec)
    assert message in str(err.value)


def test_registry_describes_every_codec():
    names = [c.name for c in hc.codecs()]
    assert names == ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd", "topk", "randomk",
                     "minmax8", "dithering", "qsgd", "terngrad", "natural", "threshold", "dgc", "powersgd"]
    for c in hc.codecs():
        assert c.collective in ("allreduce", "allgather")
        assert c.aggregation in ("mean", "majority")
        assert c.wire and c.doc
    assert [c.name for c in hc.codecs() if c.linear] == ["none", "fp16", "randomk", "powersgd"]
    assert hc.get_codec("bf16").collective_note  # says why bf16 is gathered


def test_bucket_mb_in_the_spec_sets_the_buckets_but_not_the_states_identity():
    from hvd_compress.buckets import bucket_bytes
    cfg = hc.parse_spec("topk,k=0.01,ef=vanilla,bucket_mb=4")
    assert cfg.bucket_mb == 4.0 and str(cfg) == "topk,k=0.01,ef=vanilla,bucket_mb=4.0"
    assert cfg.canonical() == hc.parse_spec("topk,k=0.01,ef=vanilla").canonical()
    assert hc.parse_spec({"compressor": "onebit", "bucket_mb": 0.5}).bucket_mb == 0.5
    assert bucket_bytes(None, cfg) == bucket_bytes(4, cfg) == 4 << 20
    assert bucket_bytes(None, hc.parse_spec("onebit")) == 0
    assert bucket_bytes(2, hc.parse_spec("onebit")) == 2 << 20
    with pytest.raises(ValueError, match="bucket_mb=1 is given to the optimizer but the "
                                         "compression spec says bucket_mb=4.0; set it in one"):
        bucket_bytes(1, cfg)


def test_granularity_is_part_of_the_spec_when_not_the_default():
    tensor = hc.parse_spec("dgc,k=0.01,granularity=tensor")
    assert tensor.granularity == "tensor" and "granularity=tensor" in tensor.canonical()
    assert str(tensor).endswith(",granularity=tensor") and hc.parse_spec(str(tensor)) == tensor
    bucket = hc.parse_spec("dgc,k=0.01,granularity=bucket")
    assert bucket == hc.parse_spec("dgc,k=0.01") and "granularity" not in bucket.canonical()


def test_fingerprint_differs_between_specs():
    assert hc.parse_spec("topk,k=0.01").fingerprint() != hc.parse_spec("topk,k=0.02").fingerprint()


def test_core_imports_without_frameworks():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *a):\n"
            "        if name.split('.')[0] in ('torch', 'tensorflow', 'horovod'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hvd_compress\n"
            "print(hvd_compress.parse_spec('topk,k=0.1').canonical())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "topk,k=0.1,ef=none,momentum=none,seed=0"


def test_derive_seed_is_stable_and_does_not_touch_global_rng():
    import random
    import numpy as np
    state = (random.getstate(), np.random.get_state()[1].copy())
    a = hc.derive_seed(0, "layer1.weight", 5)
    assert a == hc.derive_seed(0, "layer1.weight", 5)
    assert len({a, hc.derive_seed(0, "layer1.weight", 6), hc.derive_seed(0, "layer1.bias", 5),
                hc.derive_seed(1, "layer1.weight", 5)}) == 4
    assert 0 <= a < 2**64
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()


def test_readme_codec_table_is_the_registry():
    import os
    from hvd_compress.registry import codec_table
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    assert codec_table() in readme, "README's codec table is stale: paste registry.codec_table()"


def test_kernel_fields_resolve_k_per_tensor():
    assert hc.parse_spec("topk,k=0.01").kernel_fields(1000) == {"k": 10}
    assert hc.parse_spec("randomk,k=50,rescale=true").kernel_fields(20) == {"k": 20, "rescale": True}
    assert hc.parse_spec("minmax8,chunk=64").kernel_fields(5) == {"chunk": 64}
    assert hc.parse_spec("fp16").kernel_fields(5) == {}


def test_average_factors():
    assert hc.get_codec("fp16").average_factors(True, 4) == (0.25, 1.0)  # divide before the sum
    assert hc.get_codec("topk").average_factors(True, 4) == (1.0, 0.25)  # divide when decoding
    assert hc.get_codec("fp16").average_factors(False, 4) == (1.0, 1.0)


@pytest.mark.parametrize("spec, momentum, fix", [
    ("onebit,ef=vanilla", 0.9, "onebit,scaling=true,ef=vanilla,momentum=nesterov,mu=0.9"),
    ("topk,k=0.01,ef=vanilla", 0.5, "topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.5"),
    # random-k diverges with momentum on either side of the codec: top-k is the fix
    ("randomk,k=0.01,ef=vanilla", 0.9, "topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.9"),
    ("randomk,k=0.05,ef=vanilla,momentum=nesterov,mu=0.5", 0.0,
     "topk,k=0.05,ef=vanilla,momentum=nesterov,mu=0.5"),
    ("onebit", 0.9, None), ("randomk,k=0.01", 0.9, None), ("randomk,k=0.01,ef=vanilla", 0, None),
    ("onebit,ef=vanilla,momentum=nesterov", 0.0, None), ("dgc,k=0.01", 0.9, None),
    # PowerSGD's residual is its error_feedback parameter
    ("powersgd,rank=2,start_iter=50", 0.9,
     "powersgd,rank=2,start_iter=50,min_compression_rate=2.0,error_feedback=true,"
     "warm_start=true,orthogonalization_epsilon=0.0,batch_same_shape=false,"
     "momentum=nesterov,mu=0.9"),
    ("powersgd,error_feedback=false", 0.9, None), ("powersgd,momentum=nesterov", 0.9, None),
])
def test_momentum_advice_names_the_spec_that_trains(spec, momentum, fix):
    from hvd_compress.spec import momentum_advice, momentum_fix
    advice = momentum_advice(hc.parse_spec(spec), momentum)
    assert momentum_fix(hc.parse_spec(spec), momentum) == fix
    if fix is None:
        assert advice is None
    else:
        assert f'compression="{fix}"' in advice
        assert str(hc.parse_spec(fix)) == fix  # what bench/convergence.py --advised runs


@pytest.mark.parametrize("spec, taken", [
    ("topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.8", ("nesterov", 0.8, "momentum")),
    ("none,momentum=nesterov", ("nesterov", 0.9, "momentum")),
    ("dgc", ("heavy_ball", 0.9, "dgc_velocity")),
    ("dgc,momentum_factor=0.5", ("heavy_ball", 0.5, "dgc_velocity")),
    ("powersgd,momentum=nesterov,mu=0.5", ("nesterov", 0.5, "momentum")),
    ("onebit,ef=vanilla", None), ("powersgd", None), ("none", None)])
def test_spec_momentum_names_what_uncompressed_gradients_get(spec, taken):
    from hvd_compress.spec import spec_momentum
    assert spec_momentum(hc.parse_spec(spec)) == taken


@pytest.mark.parametrize("shape,matrix", [
    ((70,), (70, 1)), ((40, 30), (40, 30)), ((40, 6, 5), (40, 30)),
    ((64, 64, 3, 3), (64, 576)),      # PyTorch's (O, I, H, W): the first dimension, as DDP's hook
    ((3, 3, 64, 64), (576, 64)),      # TensorFlow's (H, W, I, O): before O
    ((7, 7, 3, 64), (147, 64)), ((1, 1, 256, 64), (256, 64)), ((2, 2), (2, 2))])
def test_powersgd_views_a_gradient_as_its_squarest_matrix(shape, matrix):
    from hvd_compress.powersgd import matrix_shape
    assert matrix_shape(shape) == matrix


def test_powersgd_compresses_a_keras_conv_kernel():
    """3 x 36864, the first dimension's view, is below min_compression_rate at rank 4."""
    from hvd_compress.powersgd import PowerSGDState
    st = PowerSGDState.from_config(hc.parse_spec("powersgd,rank=4"))
    assert st.compresses((3, 3, 64, 64)) and st.compresses((64, 64, 3, 3))
    assert not st.compresses((3, 36864))
