"""The collective strategies' policy, without Horovod: chunk boundaries, payload sizes (the
registry's Python formulas against the kernels), the cost model and the per-tensor choice."""
import itertools

import pytest
import torch

import hvd_compress as hc
from hvd_compress import collectives as col
from hvd_compress.torch import _C
from hvd_compress.torch.codec import TorchCodec, kernel_params


def job(spec, n, world, itemsize=4, rank=0, step=0, gloo=False):
    return col.Job(name="w", n=n, itemsize=itemsize, config=hc.parse_spec(spec), rank=rank,
                   world=world, average=True, opname="w", step=step, fields_step=step,
                   gloo=gloo)


@pytest.mark.parametrize("n,world", list(itertools.product([0, 1, 7, 63, 64, 65, 1000, 4097, 100003],
                                                           [1, 2, 3, 4, 8, 64])))
def test_chunk_bounds_cover_the_tensor_once_on_aligned_boundaries(n, world):
    b = col.chunk_bounds(n, world)
    assert len(b) == world + 1 and b[0] == 0 and b[-1] == n
    assert all(x <= y for x, y in zip(b, b[1:]))
    assert all(x % col.CHUNK_ALIGN == 0 or x == n for x in b)
    sizes = [y - x for x, y in zip(b, b[1:])]
    # each owner gets n/world elements to within one alignment step
    assert all(abs(size - n / world) < col.CHUNK_ALIGN for size in sizes)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd",
                                  "topk,k=0.05", "topk,k=7", "randomk,k=0.1", "minmax8",
                                  "minmax8,chunk=100", "dithering", "dithering,s=3", "qsgd",
                                  "terngrad", "natural", "threshold", "dgc,k=0.01"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4097])
def test_registry_payload_bytes_equal_the_kernels(spec, dtype, n):
    cfg = hc.parse_spec(spec)
    x = torch.zeros(n, dtype=dtype)
    fields = cfg.kernel_fields(n)
    want = _C.new_payload(cfg.info.kernel_id, x, kernel_params(cfg, n))
    assert cfg.info.payload_bytes(x.element_size(), n, fields) == want.numel() * want.element_size()


def test_topk_count_is_shared_out_by_chunk_length_and_sums_to_k():
    for n, world, k in [(1000, 3, "0.05"), (10, 4, "3"), (1, 8, "0.5"), (100003, 8, "0.001")]:
        j = job(f"topk,k={k}", n, world)
        parts = col.chunks(j)
        total = j.info.kept(j.config.param_dict, n)
        ks = [p.field_dict["k"] for p in parts]
        assert sum(ks) == total and all(0 <= kk <= p.n for kk, p in zip(ks, parts))


def test_seed_keys_differ_by_chunk_rank_and_owner():
    keys = {p.seed_key for r in range(3) for p in col.chunks(job("dithering", 999, 3, rank=r))}
    keys |= {p.seed_key for p in col.chunks(job("dithering", 999, 3), owner_key=True)}
    assert len(keys) == 12
    # owners' keys do not depend on which rank computes them: every rank decodes alike
    assert ([p.seed_key for p in col.chunks(job("dithering", 999, 3, rank=0), owner_key=True)]
            == [p.seed_key for p in col.chunks(job("dithering", 999, 3, rank=2), owner_key=True)])


@pytest.mark.parametrize("codec", ["onebit", "topk,k=0.01", "minmax8", "dithering", "qsgd",
                                   "terngrad", "natural", "bf16", "efsignsgd"])
def test_auto_keeps_allgather_at_two_ranks_and_scales_from_three(codec):
    n = 1 << 20
    assert col.choose(job(codec, n, 2)) == col.ALLGATHER
    for world in (3, 4, 8, 64, 256):
        j = job(codec, n, world)
        assert col.choose(j) == col.COMPRESSED_ALLREDUCE
        one = j.info.payload_bytes(4, n, j.config.kernel_fields(n))
        # bandwidth-optimal 2(w-1)/w payloads, within the headers of the chunks
        assert j.wire_bytes <= 1.15 * 2 * (world - 1) / world * one


def test_allgather_bytes_grow_with_ranks_and_compressed_stay_flat():
    n = 1 << 20
    for codec in ("onebit", "minmax8"):
        gathered = [col.wire_bytes(col.ALLGATHER, hc.get_codec(codec), 4,
                                   col.whole(job(codec, n, w)), [], w) for w in (2, 8)]
        assert gathered[1] == pytest.approx(7 * gathered[0])
        j2, j8 = job(codec + ",collective=allreduce", n, 2), job(codec + ",collective=allreduce", n, 8)
        col.choose(j2), col.choose(j8)
        assert j8.wire_bytes <= 2 * j2.wire_bytes


def test_tiny_tensors_stay_on_allgather_where_headers_dominate():
    assert col.choose(job("onebit", 10, 8)) == col.ALLGATHER


def test_linear_codecs_keep_horovod_allreduce_under_auto():
    for spec in ("fp16", "randomk", "none"):
        assert col.choose(job(spec, 1 << 20, 8)) == col.ALLREDUCE
    assert col.choose(job("fp16,collective=allreduce", 1 << 20, 8)) == col.COMPRESSED_ALLREDUCE


def test_fp16_gathers_by_sum_only_between_two_ranks_over_gloo():
    assert col.choose(job("fp16", 1 << 20, 2, gloo=True)) == col.ALLGATHER
    for world, gloo in ((2, False), (3, True), (8, True)):
        assert col.choose(job("fp16", 1 << 20, world, gloo=gloo)) == col.ALLREDUCE
    # the spec's own choice stands; randomk has no allgather to take
    assert col.choose(job("fp16,collective=allreduce", 1 << 20, 2, gloo=True)) \
        == col.COMPRESSED_ALLREDUCE
    assert col.choose(job("randomk", 1 << 20, 2, gloo=True)) == col.ALLREDUCE


def pair_codecs(spec):
    """Each rank's frontend codec, as in two processes: the buffers it keeps are its own."""
    return [TorchCodec(hc.parse_spec(spec), None, rank=r, world=2) for r in range(2)]


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("nbytes", [1, 2, 3, 4, 5, 1001, 4096])
def test_gather_rows_by_sum_returns_both_payloads(nbytes, offset):
    """Two ranks' gather_rows plans driven together, the allreduce done as Horovod's int32 sum
    (wrapping): every rank gets both random payloads in rank order, bit for bit, whole words or
    not, at an address of a whole word or not (offset), in two steps through the buffers the
    first one left (torch keeps them). Elsewhere the plan asks for the allgather itself."""
    gen = torch.Generator().manual_seed(nbytes)
    codecs = pair_codecs("bf16")
    kept = None
    for _ in range(2):
        payloads = [torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8,
                                  generator=gen)[offset:] for _ in range(2)]
        plans = [col.gather_rows(job("bf16", nbytes, 2, rank=r, gloo=True), codecs[r],
                                 payloads[r], "w") for r in range(2)]
        asked = [next(p) for p in plans]
        assert all(isinstance(a, col.Allreduce) and a.tensor.dtype == torch.int32 for a in asked)
        summed = asked[0].tensor + asked[1].tensor
        got = []
        for p in plans:
            with pytest.raises(StopIteration) as done:
                p.send(summed.clone())
            got.append(done.value.value)
        want = torch.cat(payloads)
        assert all(torch.equal(g, want) for g in got)
        kept = kept or [g.data_ptr() for g in got]
        assert [g.data_ptr() for g in got] == kept
    for world, gloo in ((2, False), (3, True)):
        plan = col.gather_rows(job("bf16", nbytes, world, gloo=gloo), codecs[0], payloads[0],
                               "w")
        assert isinstance(next(plan), col.Allgather)


@pytest.mark.parametrize("sizes", [(1, 5), (8, 8), (1001, 3), (4096, 4100), (12, 8), (3, 3)])
def test_gather_sized_by_sum_returns_both_payloads(sizes):
    """Threshold's payloads differ in size by rank: between two ranks over Gloo, a sum of both
    sizes first, then of the words of both payloads padded to the larger; every rank gets both
    payloads, back to back in rank order, bit for bit, in a first step and in a second whose
    payloads are larger (the kept buffers grow) or smaller."""
    gen = torch.Generator().manual_seed(sum(sizes))
    codecs = pair_codecs("threshold")
    for step_sizes in (sizes, tuple(n + 37 for n in sizes), tuple(n // 2 for n in sizes)):
        payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
                    for n in step_sizes]
        first = [col.gather_sized(job("threshold", 64, 2, rank=r, gloo=True), codecs[r],
                                  payloads[r], "w") for r in range(2)]
        asked = [next(p) for p in first]
        assert all(a.name == "w.sizes" for a in asked)
        sizes_sum = asked[0].tensor + asked[1].tensor
        assert sizes_sum.tolist() == list(step_sizes)
        second = [p.send(sizes_sum.clone()) for p in first]
        summed = second[0].tensor + second[1].tensor
        assert 4 * summed.numel() == -(-max(step_sizes) // 4) * 4
        want = torch.cat(payloads)
        for p in first:
            with pytest.raises(StopIteration) as done:
                p.send(summed.clone())
            assert torch.equal(done.value.value, want)
    plan = col.gather_sized(job("threshold", 64, 2), codecs[0], payloads[0], "w")
    assert isinstance(next(plan), col.Allgather)


def test_forced_collectives_and_refusals():
    assert col.choose(job("onebit,collective=allgather", 1 << 20, 8)) == col.ALLGATHER
    assert col.choose(job("onebit,collective=allreduce", 10, 8)) == col.COMPRESSED_ALLREDUCE
    with pytest.raises(ValueError, match="randomk cannot travel by collective=allgather; "
                                         "valid for randomk: auto, allreduce"):
        hc.parse_spec("randomk,collective=allgather")
    with pytest.raises(ValueError, match="collective='ring' is not valid; valid: auto, "
                                         "allgather, allreduce, homomorphic"):
        hc.parse_spec("onebit,collective=ring")


def test_collective_is_part_of_the_spec_only_when_set():
    assert "collective" not in hc.parse_spec("onebit").canonical()
    assert hc.parse_spec("onebit,collective=allreduce").canonical().endswith("collective=allreduce")
    assert hc.parse_spec("onebit").fingerprint() != hc.parse_spec("onebit,collective=allgather").fingerprint()


def test_hierarchical_takes_true_false_or_fp16():
    two = hc.parse_spec("onebit,hierarchical=true")
    half = hc.parse_spec("onebit,hierarchical=fp16")
    assert two.hierarchical and not two.node_fp16
    assert half.hierarchical and half.node_fp16
    assert not hc.parse_spec("onebit,hierarchical=false").hierarchical
    assert half.canonical().endswith("hierarchical=fp16") and str(half).endswith("hierarchical=fp16")
    assert hc.parse_spec(half.canonical()) == half
    assert hc.parse_spec({"compressor": "onebit", "hierarchical": "FP16"}) == half
    assert "hierarchical" not in hc.parse_spec("onebit").canonical()
    with pytest.raises(ValueError, match="hierarchical must be true, false or fp16 .*got 'bf16'"):
        hc.parse_spec("onebit,hierarchical=bf16")
