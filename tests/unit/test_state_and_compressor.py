"""The state store, the single-process codec pipeline and the Horovod-protocol compressors."""
import numpy as np
import pytest
import torch

import numpy_ref as ref
from helpers import random_grad, same_bits, t2n
import hvd_compress as hc
from hvd_compress.torch import Compression
from hvd_compress.torch.codec import TorchAdapter, TorchCodec


def store(spec=""):
    return hc.StateStore(TorchAdapter(), spec=spec)


def test_slots_are_keyed_by_name_and_persist():
    s = store()
    g = torch.ones(3, 4)
    e = s.slot("w", "ef", g)
    e += 1
    assert s.slot("w", "ef", torch.zeros(3, 4)) is e  # a new grad tensor, same name, same state
    assert torch.equal(s.slot("b", "ef", g), torch.zeros(3, 4))


def test_shape_change_is_an_error_not_a_silent_reset():
    s = store()
    s.slot("w", "ef", torch.ones(3))
    with pytest.raises(ValueError, match=r"parameter 'w': ef state is float32\[3\] but its "
                                         r"gradient is now float32\[4\]"):
        s.slot("w", "ef", torch.ones(4))


def test_state_dict_round_trip_with_numpy_arrays_all_dtypes():
    s = store("topk")
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        s.slot(f"p_{dt}", "ef", torch.ones(5, dtype=dt)).copy_(torch.arange(5, dtype=dt) / 3)
    s.next_step("p_x")
    sd = s.state_dict()
    assert all(isinstance(a, np.ndarray) for kinds in sd["slots"].values() for a in kinds.values())
    s2 = store("topk")
    s2.load_state_dict(sd)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        got = s2.slot(f"p_{dt}", "ef", torch.zeros(5, dtype=dt))
        assert got.dtype == dt and torch.equal(got, torch.arange(5, dtype=dt) / 3)
    assert s2.next_step("p_x") == 1


@pytest.mark.parametrize("live", [True, False])
def test_a_loaded_state_dict_is_not_changed_by_training_on(live):
    """An elastic commit or a checkpoint kept in memory is loaded again later: the slots it
    fills must not share its arrays (live: the slot exists; else it is made at first use)."""
    s = store()
    if live:
        s.slot("w", "ef", torch.zeros(4))
    sd = {"format": s.state_dict()["format"], "spec": "", "steps": {},
          "slots": {"w": {"ef": np.arange(4, dtype=np.float32)}}}
    s.load_state_dict(sd)
    s.slot("w", "ef", torch.zeros(4)).add_(100)
    assert same_bits(sd["slots"]["w"]["ef"], np.arange(4, dtype=np.float32))


def test_bad_checkpoints_are_refused_and_change_nothing():
    s = store("topk")
    live = s.slot("w", "ef", torch.ones(3))
    live.fill_(2.0)
    with pytest.raises(ValueError, match="not an hvd_compress state dict"):
        s.load_state_dict({"slots": {}})
    good = s.state_dict()
    bad = {**good, "slots": {"w": {"ef": np.zeros(4, np.float32)}}}
    with pytest.raises(ValueError, match=r"checkpointed ef state has shape \[4\], the live one \[3\]"):
        s.load_state_dict(bad)
    assert s.slot("w", "ef", torch.ones(3)) is live and torch.equal(live, torch.full((3,), 2.0))
    other = store("onebit")
    with pytest.raises(ValueError, match="saved with spec 'topk'"):
        other.load_state_dict(good)
    other.load_state_dict(good, strict_spec=False)


def test_pipeline_momentum_then_error_feedback_matches_reference():
    cfg = hc.parse_spec("topk,k=0.1,ef=vanilla,momentum=nesterov,mu=0.8")
    codec = TorchCodec(cfg, store())
    m_ref = np.zeros(300, np.float32)
    e_ref = np.zeros(300, np.float32)
    for step in range(4):
        g = random_grad(300, "float32", seed=step)
        x_ref, m_ref = ref.nesterov(t2n(g), m_ref, 0.8, "float32")
        want, e_ref = ref.ef_encode("topk", x_ref, e_ref, "float32", k=30)
        m_ref[e_ref == 0] = 0  # momentum factor masking: what was sent takes its momentum along
        enc = codec.encode("w", g)
        assert enc.payload.numpy().tobytes() == want
    assert same_bits(t2n(codec.store.slot("w", "ef", g)), e_ref)
    assert same_bits(t2n(codec.store.slot("w", "momentum", g)), m_ref)


def test_randomk_seed_follows_name_and_step():
    cfg = hc.parse_spec("randomk,k=0.1,seed=5")
    s = store()
    codec = TorchCodec(cfg, s)
    x = torch.arange(1000, dtype=torch.float32)
    picks = [codec.encode("w", x).payload.clone() for _ in range(2)] + [codec.encode("v", x).payload]
    for i, (name, step) in enumerate([("w", 0), ("w", 1), ("v", 0)]):
        idx, _ = ref.randomk_strata(1000, 100, hc.derive_seed(5, name, step))
        assert picks[i].numpy().astype(int).tolist() == idx.tolist()


def test_compressor_protocol_for_linear_codecs():
    x = random_grad(1000, "float32")
    payload, ctx = Compression.fp16.compress(x)
    assert payload.dtype == torch.float16
    assert torch.equal(Compression.fp16.decompress(payload, ctx), x.half().float())
    payload, ctx = Compression.randomk(k=0.1).compress(x)
    assert payload.numel() == 100
    out = Compression.randomk(k=0.1).decompress(payload, ctx)
    assert (out != 0).sum() <= 100 and torch.equal(out[out != 0], x[out != 0])
    t, ctx = Compression.none.compress(x)
    assert t is x and Compression.none.decompress(t, ctx) is x


@pytest.mark.parametrize("codec", ["onebit", "signsgd", "efsignsgd", "topk", "bf16"])
def test_compressor_protocol_refuses_allgather_codecs(codec):
    with pytest.raises(RuntimeError, match=f"{codec} payloads travel by allgather.*"
                                           "hvd_compress.torch.DistributedOptimizer"):
        getattr(Compression, codec).compress(torch.ones(10))


def test_compressor_protocol_refuses_stateful_decorators():
    with pytest.raises(RuntimeError, match="error feedback and momentum keep state per parameter"):
        Compression.fp16(ef="vanilla").compress(torch.ones(10))


def test_compression_namespace():
    assert Compression.topk(k=0.5).config == hc.parse_spec("topk,k=0.5")
    assert Compression.from_spec({"compressor": "onebit"}) == Compression.onebit
    with pytest.raises(AttributeError, match="no codec 'zip'; valid codecs: none, fp16"):
        Compression.zip
    with pytest.raises(ValueError, match="has no parameter 'k'"):
        Compression.onebit(k=3)


def test_unsupported_dtype_and_device_errors():
    codec = TorchCodec(hc.parse_spec("onebit"), store())
    with pytest.raises(ValueError, match="gradient has dtype torch.int32; compression supports"):
        codec.encode("w", torch.ones(3, dtype=torch.int32))


def test_rollback_restores_touched_slots_and_counters_and_removes_new_ones():
    s = store()
    e = s.slot("w", "ef", torch.ones(3))
    e.fill_(1.0)
    s.next_step("w")
    s.begin()
    s.slot("w", "ef", torch.ones(3)).fill_(7.0)
    assert s.next_step("w") == 1
    s.slot("b", "ef", torch.ones(2)).fill_(5.0)
    s.next_step("b")
    assert s.touched()
    s.rollback()
    assert not s.in_step and torch.equal(e, torch.ones(3)) and s.slot("w", "ef", e) is e
    assert s.state_dict()["steps"] == {"w": 1} and set(s.state_dict()["slots"]) == {"w"}
    s.begin()
    s.slot("w", "ef", e).fill_(2.0)
    s.commit()
    s.begin()
    s.rollback()  # touched nothing: nothing changes
    assert torch.equal(e, torch.full((3,), 2.0))


def test_a_rewritten_slot_keeps_its_old_tensor_as_the_backup_without_a_copy():
    """rewrite(): the kernel reads src and writes dst, which is the slot from then on; src is
    the step's backup, untouched, and dst the buffer an earlier step's backup went into."""
    s = store()
    like = torch.ones(4)
    a = s.slot("w", "ef", like)
    a.fill_(1.0)
    src, dst = s.rewrite("w", "ef", like)  # no step open: in place
    assert src is a and dst is a
    buffers = {id(a)}
    for step, value in enumerate([2.0, 3.0, 4.0]):
        s.begin()
        src, dst = s.rewrite("w", "ef", like)
        assert src is not dst and torch.equal(src, torch.full((4,), value - 1))
        again = s.rewrite("w", "ef", like)  # a later part of the same step
        assert again[0] is src and again[1] is dst
        dst.copy_(src + 1)
        s.commit()
        assert s.peek("w", "ef") is dst
        assert np.array_equal(s.state_dict()["slots"]["w"]["ef"], np.full(4, value, np.float32))
        buffers |= {id(src), id(dst)}
    assert len(buffers) == 2  # two buffers in turn, none made per step
    s.begin()
    src, dst = s.rewrite("w", "ef", like)
    dst.fill_(99.0)
    s.rollback()
    assert s.peek("w", "ef") is src and torch.equal(src, torch.full((4,), 4.0))
    s.begin()  # the rolled-back step's buffer is the one written next
    again = s.rewrite("w", "ef", like)
    assert again[0] is src and again[1] is dst
    s.rollback()
    with pytest.raises(ValueError, match=r"ef state is float32\[4\] but its gradient is now"):
        s.rewrite("w", "ef", torch.ones(5))


def test_a_slot_touched_or_made_in_the_step_is_rewritten_in_place():
    """Where the step already holds a backup (a copy, or the slot is new), src is dst: the
    backup must not become the slot."""
    s = store()
    like = torch.ones(3)
    s.slot("w", "ef", like).fill_(1.0)
    s.begin()
    s.rescale(2.0)
    s.rescale(4.0)  # touches every slot: a copy is the backup
    src, dst = s.rewrite("w", "ef", like)
    assert src is dst and torch.equal(dst, torch.full((3,), 2.0))
    made = s.rewrite("b", "ef", like)
    assert made[0] is made[1]
    dst.fill_(5.0)
    s.rollback()
    assert torch.equal(s.peek("w", "ef"), torch.ones(3)) and s.peek("b", "ef") is None


def test_a_moved_slot_lives_in_the_given_storage_and_its_old_tensor_is_the_backup():
    """move(): the slot moves into storage the frontend gives (a bucket's second buffer); the
    old tensor, unwritten, is the step's backup, so a rollback puts it back without a copy.
    Only a live slot the open step has not touched moves."""
    s = store()
    like = torch.ones(2, 3)
    a = s.slot("w", "ef", like)
    a.fill_(1.0)
    assert not s.movable("w", "ef")  # no step open
    buffer = torch.zeros(10)
    s.begin()
    assert s.movable("w", "ef") and not s.movable("b", "ef")  # "b" does not exist
    s.move("w", "ef", buffer[2:8].view(2, 3))
    moved = s.peek("w", "ef")
    assert moved.data_ptr() == buffer[2:].data_ptr() and not s.movable("w", "ef")
    moved.copy_(a + 1)
    s.commit()
    assert s.peek("w", "ef") is moved and torch.equal(a, torch.ones(2, 3))
    assert np.array_equal(s.state_dict()["slots"]["w"]["ef"], np.full((2, 3), 2.0, np.float32))
    s.begin()
    s.move("w", "ef", a)  # back into the first storage, written from the second
    a.copy_(moved + 1)
    s.rollback()
    assert s.peek("w", "ef") is moved and torch.equal(moved, torch.full((2, 3), 2.0))
    s.begin()
    s.slot("w", "ef", like)  # touched: its backup is a copy, and it stays where it is
    with pytest.raises(RuntimeError, match="slot ef of 'w' cannot move"):
        s.move("w", "ef", a)
    s.rollback()
    s.begin()
    with pytest.raises(ValueError, match=r"ef state is float32\[2, 3\] but its gradient is now"):
        s.move("w", "ef", torch.zeros(6))
    s.rollback()


class _TracedAdapter(TorchAdapter):
    """A traced frontend's bookkeeping on torch tensors: `where` is the graph being built."""

    traced = True

    def __init__(self):
        self.where = None

    def scope(self):
        return self.where

    def restore_if(self, ran, t, saved):
        if ran:  # torch's step counters are lists
            (self.restore_counter if isinstance(t, list) else self.restore)(t, saved)


@pytest.mark.parametrize("ran", [True, False])
def test_a_traced_rollback_restores_a_branchs_state_only_where_the_branch_ran(ran):
    """A slot or counter first touched inside a conditional branch is backed up where that
    branch runs; where it did not run, its backup is an older step's and the state is as the
    step found it, so the rollback leaves it. What the step touched outside is put back."""
    a = _TracedAdapter()
    s = hc.StateStore(a)
    outer, branch = object(), object()
    a.where = outer
    s.begin()
    m = s.slot("w", "momentum", torch.ones(3))
    a.where = branch
    e = s.slot("w", "ef", torch.ones(3))
    s.next_step("w")
    a.where = outer
    s.commit()
    m.fill_(1.0)
    e.fill_(2.0)
    s.begin()
    s.slot("w", "momentum", m).fill_(5.0)
    a.where = branch
    s.slot("w", "ef", e).fill_(6.0)
    s.next_step("w")
    a.where = outer
    assert s.touched_in_branches()
    s.rollback(ran)
    assert torch.equal(m, torch.ones(3))
    assert torch.equal(e, torch.full((3,), 2.0 if ran else 6.0))
    assert s.state_dict()["steps"] == {"w": 1 if ran else 2}


def test_rollback_of_a_first_step_after_a_load_keeps_the_checkpoint_waiting():
    saved = store()
    saved.slot("w", "ef", torch.ones(3)).fill_(4.0)
    saved.next_step("w")
    s = store()
    s.load_state_dict(saved.state_dict())
    s.begin()
    s.slot("w", "ef", torch.ones(3)).fill_(9.0)
    s.next_step("w")
    s.rollback()
    assert torch.equal(s.slot("w", "ef", torch.ones(3)), torch.full((3,), 4.0))
    assert s.next_step("w") == 1



def test_a_placed_slot_keeps_its_value_and_its_step_backup():
    """place() moves a slot into the caller's storage (a bucket's buffer) with the value it had
    live, or waiting in a checkpoint; a rollback then restores into that storage, and a slot
    the rolled-back step created is gone again."""
    saved = store()
    saved.slot("w", "ef", torch.ones(3)).fill_(4.0)
    s = store()
    s.load_state_dict(saved.state_dict())
    buffer = torch.full((5,), -1.0)
    s.begin()
    w = s.place("w", "ef", buffer[:3])
    assert w.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:3], torch.full((3,), 4.0))
    s.commit()
    s.begin()
    assert s.place("w", "ef", w) is w and s.slot("w", "ef", torch.ones(3)) is w
    b = s.place("b", "ef", buffer[3:])
    assert torch.equal(b, torch.zeros(2))
    buffer.fill_(8.0)
    s.rollback()
    assert torch.equal(buffer[:3], torch.full((3,), 4.0)) and s.peek("b", "ef") is None
    assert set(s.state_dict()["slots"]) == {"w"}

def test_a_loss_scale_change_rescales_gradient_unit_state_within_the_step():
    saved = store()
    saved.slot("b", "ef", torch.ones(2)).fill_(3.0)
    s = store()
    s.load_state_dict(saved.state_dict())  # "b" waits in the checkpoint, unscaled
    s.rescale(4.0)  # the first scale seen: the state is taken to be at it
    e = s.slot("w", "ef", torch.ones(3)).fill_(8.0)
    q = s.slot("w", "powersgd_qt", torch.ones(2)).fill_(5.0)
    s.begin()
    s.rescale(1.0, scale_free=("powersgd_qt",))
    assert torch.equal(e, torch.full((3,), 2.0)) and torch.equal(q, torch.full((2,), 5.0))
    assert s.loss_scale == 1.0
    s.rollback()  # the skipped step's rescale is undone with it, the waiting slot too
    assert s.loss_scale == 4.0 and torch.equal(e, torch.full((3,), 8.0))
    assert torch.equal(s.slot("b", "ef", torch.ones(2)), torch.full((2,), 3.0))
    s.begin()
    s.rescale(8.0)
    s.commit()
    assert torch.equal(e, torch.full((3,), 16.0)) and torch.equal(q, torch.full((2,), 10.0))
    back = store()
    back.load_state_dict(s.state_dict())
    assert back.loss_scale == 8.0


def test_a_rescale_rolled_back_restores_slots_waiting_in_a_checkpoint():
    saved = store()
    saved.slot("b", "ef", torch.ones(2)).fill_(3.0)
    saved.rescale(2.0)
    s = store()
    s.load_state_dict(saved.state_dict())
    s.begin()
    s.rescale(4.0)
    assert torch.equal(s.slot("b", "ef", torch.ones(2)), torch.full((2,), 6.0))
    s.rollback()
    assert s.loss_scale == 2.0
    assert torch.equal(s.slot("b", "ef", torch.ones(2)), torch.full((2,), 3.0))


def test_stock_randomk_shows_an_element_it_did_not_draw():
    drawn = ref.randomk_strata(1000, 10, hc.derive_seed(0, "[1000]#0", 0))[0]
    x = torch.zeros(1000)
    x[drawn[0] ^ 1] = float("nan")  # a neighbour in stratum 0 [0, 100), not drawn
    payload, _ = Compression.randomk(k=0.01).compress(x)
    assert torch.isnan(payload[0]) and torch.isfinite(payload[1:]).all()
    assert torch.isfinite(Compression.randomk(k=0.01).compress(torch.zeros(1000))[0]).all()
