"""How a traced TF step branches between its compressed and uncompressed arms, read from the
graph: shared by the TF tests of buckets, lone gradients and PowerSGD."""
import horovod.tensorflow as hvd
import tensorflow as tf


def traced_arms(step, inputs, suffix: str, monkeypatch) -> tuple[list, list, list]:
    """The conds of `step` (a tf.function of `inputs`, TensorSpecs) whose else branch sends an
    allreduce named *`suffix` (the uncompressed arms), each checked to touch no state and stay
    lowered; the conds kept as calls, run only when taken: the compressing arms, and apart
    the finite check of the state they wrote (Reducer._end_step).

    An uncompressed cond that writes no variable is a StatelessIf with no control inputs: it
    waits for no other gradient's compressing cond, where TF runs a cond that writes a variable
    after every earlier op that uses it. Lowered, it sends each member as it arrives."""
    sending, real = set(), hvd.allreduce

    def allreduce(tensor, *args, name=None, **kwargs):
        if name.endswith(suffix):
            sending.add(tf.compat.v1.get_default_graph().name)
        return real(tensor, *args, name=name, **kwargs)
    monkeypatch.setattr(hvd, "allreduce", allreduce)
    graph = step.get_concrete_function(inputs).graph
    monkeypatch.setattr(hvd, "allreduce", real)
    ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    conds = [op for op in ifs if op.get_attr("else_branch").name in sending]
    assert len(conds) == len(sending), ([op.name for op in conds], sending)
    for op in conds:
        assert op.type == "StatelessIf" and not op.control_inputs, \
            (op.name, op.type, [c.name for c in op.control_inputs])
        assert op.get_attr("_lower_using_switch_merge"), op.name
    # Lowered to switches, a compressing branch's thousands of ops were walked as dead in
    # every uncompressed step.
    calls = [op for op in ifs if not op.get_attr("_lower_using_switch_merge")]
    checks = [op for op in calls if "finite_check/" in op.name]
    return conds, [op for op in calls if op not in checks], checks
