"""Checks of vfgraph's MPI ops, run by tests/ops/test_mpi_ops.py in fresh processes.

    mpiexec -n 2 python mpi_ops_worker.py collectives MODEL_DIR   # every op; rank 0 saves a model
    mpiexec -n 2 python mpi_ops_worker.py load-saved MODEL_DIR    # the saved model after import vfgraph
    python mpi_ops_worker.py unregistered MODEL_DIR               # without the library, then with it

Each mode runs many checks and keeps going after a failed one; rank 0 prints every rank's
failures and the process exits 1 if any check failed, else prints "ALL OK".
"""
from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402

FAILURES: list = []
CHECKS = [0]


def check(name, fn):
    """Run one named check, recording an exception or a False result as a failure."""
    CHECKS[0] += 1
    try:
        ok = fn()
        if ok is False:
            FAILURES.append(f"{name}: returned False")
    except Exception:
        FAILURES.append(f"{name}: {traceback.format_exc(limit=4)}")


def expect_error(fn, error_type, *fragments):
    """True when fn() raises error_type with every fragment in its message."""
    try:
        fn()
    except error_type as e:
        missing = [f for f in fragments if f not in str(e)]
        if missing:
            raise AssertionError(f"error lacks {missing}: {e}")
        return True
    raise AssertionError(f"expected {error_type}, nothing raised")


def equal(got, want):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"got {got.dtype}{got.shape} {got!r}, want {want.dtype}{want.shape} {want!r}")
    return True


def finish(comm):
    """Gather every rank's failures to rank 0, report, and exit."""
    everything = comm.gather((comm.Get_rank(), CHECKS[0], FAILURES), root=0) if comm else [(0, CHECKS[0], FAILURES)]
    code = 0
    if everything is not None:
        for r, n, fails in everything:
            for f in fails:
                print(f"rank {r} FAILED {f}", flush=True)
            code = code or (1 if fails else 0)
            print(f"rank {r}: {n - len(fails)}/{n} checks passed", flush=True)
        if code == 0:
            print("ALL OK", flush=True)
    if comm:
        code = comm.bcast(code, root=0)
    sys.exit(code)


def per_rank(rank, shape=(2, 3)):
    """Small integer values that differ per rank (exact in every dtype tested)."""
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * (rank + 1) + rank


def collectives(model_dir):
    import tensorflow as tf

    import vfgraph  # noqa: F401  (initialises MPI, builds and loads the ops)
    import vfgraph.ops as ops
    from mpi4py import MPI
    from vfgraph.errors import VfgraphError

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == 2, size
    reduce_types = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
    byte_types = reduce_types + [tf.uint8, tf.int8, tf.bool]

    check("rank/size", lambda: int(ops.rank()) == rank and int(ops.size()) == size)

    # allreduce: eager, every dtype; an input the caller still holds is not modified
    total = sum(per_rank(r) for r in range(size))
    for dt in reduce_types:
        def eager(dt=dt):
            x = tf.constant(per_rank(rank), dt)
            y = ops.allreduce(x)
            equal(y.numpy(), total.astype(dt.as_numpy_dtype))
            return equal(x.numpy(), per_rank(rank).astype(dt.as_numpy_dtype))
        check(f"allreduce eager {dt.name}", eager)

    # allreduce in one graph: every dtype, chained (ordered by automatic control dependencies)
    @tf.function
    def reduce_all(x):
        out = [ops.allreduce(tf.cast(x, dt)) for dt in reduce_types]
        out.append(ops.allreduce(x * 2.0 + 1.0))  # an intermediate: its buffer is reduced in place
        return out

    def graph():
        got = reduce_all(tf.constant(per_rank(rank)))
        for dt, g in zip(reduce_types, got):
            equal(g.numpy(), total.astype(dt.as_numpy_dtype))
        return equal(got[-1].numpy(), sum(per_rank(r) * 2.0 + 1.0 for r in range(size)))
    check("allreduce graph, every dtype", graph)

    def fractions():  # sums of the 16-bit types are rounded once, from float
        xs = [np.array([0.5, 0.25, 1.5, -3.0, 2048.0, 0.1, 300.0]),
              np.array([0.25, 0.125, 0.75, -1.5, 1.0, 0.2, 1.0])]
        for dt in (tf.float16, tf.bfloat16):
            d = dt.as_numpy_dtype
            want = (xs[0].astype(d).astype(np.float32) + xs[1].astype(d).astype(np.float32)).astype(d)
            equal(ops.allreduce(tf.constant(xs[rank], dt)).numpy(), want)
        return True
    check("allreduce half/bfloat16 fractions", fractions)

    def large():  # more than one MPI message's worth of shared-memory chunks
        x = np.full(3_000_001, rank + 1.0, np.float32)
        return equal(ops.allreduce(x).numpy(), np.full(3_000_001, 3.0, np.float32))
    check("allreduce 3M floats", large)

    @tf.function
    def reduce_intermediate(x):
        return ops.allreduce(x * 1.0 + float(rank))  # forwarded: reduced in place, huge pages collapsed

    def in_place_large():  # the same buffer memory again and again, with different contents
        base = np.arange(5_000_000, dtype=np.float32) % 9973
        for step in range(3):
            x = base + step
            want = size * x + sum(range(size))
            if not equal(reduce_intermediate(tf.constant(x)).numpy(), want):
                return False
        return True
    check("allreduce 20 MB in place, repeatedly", in_place_large)

    check("allreduce scalar and empty",
          lambda: equal(ops.allreduce(tf.constant(rank + 1)).numpy(), np.int32(3))
          and equal(ops.allreduce(tf.zeros([0, 4])).numpy(), np.zeros([0, 4], np.float32)))

    def stats():  # the op's counters: one call of 4 KiB adds one call, its bytes and its times
        before = ops.allreduce_stats()
        ops.allreduce(tf.ones([1024], tf.float32))
        after = ops.allreduce_stats()
        d = {k: after[k] - before[k] for k in after}
        return (d["calls"] == 1 and d["bytes"] == 4096 and d["tests"] >= 2
                and d["total_ns"] >= d["arrive_ns"] + d["reduce_ns"] > 0)
    check("allreduce counters", stats)

    # broadcast from root 0 and root 1, every dtype
    for root in (0, 1):
        for dt in byte_types:
            def bcast(dt=dt, root=root):
                x = tf.constant(per_rank(rank) % 2 if dt == tf.bool else per_rank(rank), dt)
                y = ops.broadcast(x, root=root)
                want = per_rank(root) % 2 if dt == tf.bool else per_rank(root)
                equal(y.numpy(), want.astype(dt.as_numpy_dtype))
                mine = per_rank(rank) % 2 if dt == tf.bool else per_rank(rank)
                return equal(x.numpy(), mine.astype(dt.as_numpy_dtype))
            check(f"broadcast root {root} {dt.name}", bcast)

    @tf.function
    def bcast_graph(x):
        return ops.broadcast(x * 1.0, root=1), ops.broadcast(x, root=0)

    check("broadcast graph", lambda: equal(bcast_graph(tf.constant(per_rank(rank)))[0].numpy(), per_rank(1))
          and equal(bcast_graph(tf.constant(per_rank(rank)))[1].numpy(), per_rank(0)))

    check("broadcast root out of range",
          lambda: expect_error(lambda: ops.broadcast(tf.constant(1.0), root=2), tf.errors.InvalidArgumentError,
                               "root rank 2 does not exist in a communicator of size 2"))

    def bcast_mismatch():
        x = tf.zeros([3] if rank == 0 else [4])
        if rank == 0:
            return equal(ops.broadcast(x).numpy(), np.zeros(3, np.float32))
        return expect_error(lambda: ops.broadcast(x), tf.errors.InvalidArgumentError,
                            "rank 1 has a float input of shape [4] but root rank 0 has a float input of shape [3]")
    check("broadcast shape mismatch", bcast_mismatch)

    # broadcast_variables: in place, every byte type, root 0 and 1; a tensor read before keeps
    # the value it read (the variable gets a fresh buffer), eager and in a graph
    for root in (0, 1):
        def bcast_vars(root=root):
            vs = [tf.Variable(tf.constant(per_rank(rank) % 2 if dt == tf.bool else per_rank(rank), dt))
                  for dt in byte_types]
            held = vs[2].read_value()
            ops.broadcast_variables(vs, root=root)
            for v, dt in zip(vs, byte_types):
                want = per_rank(root) % 2 if dt == tf.bool else per_rank(root)
                equal(v.numpy(), want.astype(dt.as_numpy_dtype))
            return equal(held.numpy(), per_rank(rank).astype(np.float32))
        check(f"broadcast_variables root {root}", bcast_vars)

    graph_vars = [tf.Variable(per_rank(rank, (3,))), tf.Variable(tf.constant(rank, tf.int64))]

    @tf.function
    def bcast_vars_graph():
        ops.broadcast_variables(graph_vars, root=1)
        return graph_vars[0].read_value(), graph_vars[1].read_value()

    check("broadcast_variables graph", lambda: equal(bcast_vars_graph()[0].numpy(), per_rank(1, (3,)))
          and equal(graph_vars[1].numpy(), np.int64(1)))

    def bcast_vars_mismatch():
        vs = [tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([3] if rank == 0 else [4]))]
        if rank == 0:
            ops.broadcast_variables(vs)
            return equal(vs[1].numpy(), np.zeros(3, np.float32))
        return expect_error(lambda: ops.broadcast_variables(vs), tf.errors.InvalidArgumentError,
                            "rank 1 has variable 1 (", "as float of shape [4] but root rank 0 has it as float of "
                            "shape [3]")
    check("broadcast_variables shape mismatch", bcast_vars_mismatch)

    def bcast_vars_count():
        vs = [tf.Variable(tf.zeros([2])) for _ in range(2 if rank == 0 else 3)]
        if rank == 0:
            ops.broadcast_variables(vs)
            return True
        return expect_error(lambda: ops.broadcast_variables(vs), tf.errors.InvalidArgumentError,
                            "rank 1 has 3 variables but root rank 0 has 2")
    check("broadcast_variables count mismatch", bcast_vars_count)

    # allgather: uneven first dimension (rank 0: 2 rows, rank 1: 3 rows)
    rows = [per_rank(r, (2 + r, 2)) for r in range(size)]
    for dt in byte_types:
        def gather(dt=dt):
            mine = rows[rank] % 2 if dt == tf.bool else rows[rank]
            want = np.concatenate([(x % 2 if dt == tf.bool else x) for x in rows]).astype(dt.as_numpy_dtype)
            return equal(ops.allgather(tf.constant(mine, dt)).numpy(), want)
        check(f"allgather uneven {dt.name}", gather)

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def gather_graph(x):
        y = ops.allgather(x)
        assert y.shape.as_list() == [None, 2], y.shape
        return y

    check("allgather graph", lambda: equal(gather_graph(tf.constant(rows[rank], tf.float32)).numpy(),
                                           np.concatenate(rows).astype(np.float32)))
    check("allgather one rank empty", lambda: equal(
        ops.allgather(tf.ones([0 if rank == 0 else 2, 3])).numpy(), np.ones([2, 3], np.float32)))
    check("allgather other dims differ", lambda: expect_error(
        lambda: ops.allgather(tf.zeros([2, 3 + rank])), tf.errors.InvalidArgumentError,
        "same shape except for dimension 0", "rank 0 has float [2,3] and rank 1 has float [2,4]"))
    check("allgather rank differs", lambda: expect_error(
        lambda: ops.allgather(tf.zeros([2, 3] if rank == 0 else [2, 3, 1])), tf.errors.InvalidArgumentError,
        "rank 0 has float [2,3] and rank 1 has float [2,3,1]"))
    check("allgather scalar", lambda: expect_error(
        lambda: ops.allgather(tf.constant(1.0) if rank == 1 else tf.zeros([1])), tf.errors.InvalidArgumentError,
        "need at least one dimension", "rank 1 has float []"))

    # check: equal fingerprints pass, different ones fail on every rank
    same = "ab" * 32
    check("check equal eager", lambda: ops.check(same, "model m") is None)

    @tf.function
    def checked(x):
        with tf.control_dependencies([ops.check(same, "model m")]):
            return ops.allreduce(x)

    check("check equal graph", lambda: equal(checked(tf.constant(1.0)).numpy(), np.float32(2.0)))
    differ = ("0123456789abcdef" * 4) if rank == 0 else ("fedcba9876543210" * 4)
    check("check different", lambda: expect_error(
        lambda: ops.check(differ, "model m"), tf.errors.FailedPreconditionError,
        "VfCheck: ranks run different graphs (model m): rank 0 has fingerprint 0123456789ab.., "
        "rank 1 has fedcba987654..; rewrite once and give every rank the same model"))
    check("check long fingerprints", lambda: expect_error(
        lambda: ops.check("x" * 100 + str(rank), "long"), tf.errors.FailedPreconditionError,
        "ranks run different graphs (long)"))
    check("check after failures still in step",
          lambda: equal(ops.allreduce(tf.constant([rank], tf.int64)).numpy(), np.array([1], np.int64)))

    # send/recv between the two stages of one pipeline (rank r is stage r): every dtype and
    # shape there and back, messages matched by tag whatever order they are posted in
    peer = 1 - rank
    for dt in byte_types + [tf.int16, tf.uint16]:
        def there_and_back(dt=dt):
            value = np.arange(6).reshape(2, 3) % 2 if dt == tf.bool else np.arange(6).reshape(2, 3)
            x = tf.constant(value, dt)
            if rank == 0:
                ops.send(x, 7, stage=1, stages=2)
                back = ops.recv(8, dt, stage=1, stages=2, shape=[None, 3])
            else:
                got = ops.recv(7, dt, stage=0, stages=2)
                ops.send(got, 8, stage=0, stages=2)
                back = got
            return equal(back.numpy(), x.numpy()) and back.shape == (2, 3)
        check(f"send/recv {dt.name}", there_and_back)
    check("send/recv empty and scalar", lambda: all(
        equal(ops.recv(t, tf.float32, stage=peer, stages=2).numpy(), v)
        for t, v in ((20, np.zeros((0, 4), np.float32)), (21, np.float32(3)))
        if ops.send(tf.constant(v), t, stage=peer, stages=2) is None))

    def large_crossed():
        """Two 12 MB messages each way, the second received first. A send completes when its
        receive is posted, so the sends must not wait for each other, as in a pipeline's
        rewritten graph: a TF1 graph (tf.function would chain the stateful ops in program
        order)."""
        g = tf.Graph()
        with g.as_default():
            x = tf.range(3_000_000, dtype=tf.float32) * float(rank + 1)
            sends = [ops.send(x, 30, stage=peer, stages=2), ops.send(x + 1.0, 31, stage=peer, stages=2)]
            b = ops.recv(31, tf.float32, stage=peer, stages=2, shape=[None])
            with tf.control_dependencies([b]):
                a = ops.recv(30, tf.float32, stage=peer, stages=2, shape=[None])
        with tf.compat.v1.Session(graph=g) as sess:
            a, b, _ = sess.run([a, b, sends])
        want = np.arange(3_000_000, dtype=np.float32) * float(peer + 1)
        return equal(a, want) and equal(b, want + 1.0)

    check("send/recv 12 MB each way, crossed", large_crossed)
    check("recv of another dtype", lambda: expect_error(
        lambda: (ops.send(tf.constant([1.0]), 40, stage=peer, stages=2),
                 ops.recv(40, tf.int32, stage=peer, stages=2)),
        tf.errors.InvalidArgumentError, "sent float where this graph expects int32"))
    check("stages the ranks cannot hold", lambda: expect_error(
        lambda: ops.send(tf.constant(1.0), 41, stage=0, stages=3), tf.errors.FailedPreconditionError,
        "runs 3 pipeline stages, which 2 ranks cannot hold"))
    def idle_wait():
        """A receive whose message is late waits on a thread at SCHED_IDLE (policy 5), which
        takes a CPU only when nothing else of the host wants it."""
        import threading
        import time

        if rank == 0:
            time.sleep(1.0)
            ops.send(tf.constant([5.0]), 50, stage=1, stages=2)
            return True

        def policy(tid):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    return int(f.read().rsplit(")", 1)[1].split()[38])  # field 41, policy
            except (OSError, IndexError, ValueError):
                return -1

        got = {}
        waiting = threading.Thread(target=lambda: got.update(v=ops.recv(50, tf.float32, stage=0, stages=2).numpy()))
        waiting.start()
        idle = False
        while waiting.is_alive() and not idle:
            idle = any(policy(tid) == 5 for tid in os.listdir("/proc/self/task"))
            time.sleep(0.01)
        waiting.join()
        return idle and equal(got["v"], np.array([5.0], np.float32))

    if sys.platform.startswith("linux"):
        check("a late message waits at SCHED_IDLE", idle_wait)
    check("send/recv then collectives in step",
          lambda: equal(ops.allreduce(tf.constant([rank], tf.int64)).numpy(), np.array([1], np.int64)))

    # communicators: one per rank (each alone), a duplicate of the world, then the world again
    def communicators():
        alone = comm.Split(color=rank, key=0)
        ops.set_communicator(alone)
        equal(ops.allreduce(tf.constant([rank + 1.0])).numpy(), np.array([rank + 1.0], np.float32))
        equal(ops.size().numpy(), np.int32(1))
        dup = comm.Dup()
        ops.set_communicator(dup)
        equal(ops.allreduce(tf.constant([rank + 1.0])).numpy(), np.array([3.0], np.float32))
        ops.set_communicator(MPI.COMM_WORLD)
        return equal(ops.size().numpy(), np.int32(2))
    check("set_communicator", communicators)

    # the ranks of each pipeline stage (rank r in stage r % stages): two stages of one rank
    # each, then one stage of both ranks; without a split, the ops with stages refuse
    def stage_communicators():
        ops.set_communicator(comm.Dup(), stages=2)
        equal(ops.allreduce(tf.constant([rank + 1.0]), stages=2).numpy(), np.array([rank + 1.0], np.float32))
        equal(ops.size(stages=2).numpy(), np.int32(1))
        equal(ops.size().numpy(), np.int32(2))
        equal(ops.allreduce(tf.constant([rank + 1.0])).numpy(), np.array([3.0], np.float32))
        ops.set_communicator(comm.Dup(), stages=1)
        equal(ops.allreduce(tf.constant([rank + 1.0]), stages=1).numpy(), np.array([3.0], np.float32))
        ops.set_communicator(MPI.COMM_WORLD)
        return expect_error(lambda: ops.allreduce(tf.constant([1.0]), stages=2), tf.errors.FailedPreconditionError,
                            "sums over the replicas of each of 2 pipeline stages", "not split into stages")
    check("stage communicators", stage_communicators)
    check("stages that do not divide the ranks", lambda: expect_error(
        lambda: ops.set_communicator(comm.Dup(), stages=3), VfgraphError,
        "cannot split the ranks into 3 pipeline stages: 2 ranks are not a multiple of 3"))
    ops.set_communicator(MPI.COMM_WORLD)
    check("set_communicator rejects non-communicators", lambda: expect_error(
        lambda: ops.set_communicator(None), ValueError, "needs an mpi4py communicator"))

    # a model whose signature runs the ops, saved by rank 0 for the next processes
    class Model(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def serve(self, x):
            with tf.control_dependencies([ops.check(same, "saved model")]):
                return {"sum": ops.allreduce(x), "gathered": ops.allgather(x), "rank": ops.rank()}

    def save():
        m = Model()
        if rank == 0:
            tf.saved_model.save(m, model_dir, signatures={"serving_default": m.serve})
        comm.Barrier()
        return True
    check("save model", save)
    finish(comm)


def load_saved(model_dir):
    import tensorflow as tf

    import vfgraph  # noqa: F401  (registers the ops)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def run():
        m = tf.saved_model.load(model_dir)
        x = np.arange(rank + 1, dtype=np.float32) + 10 * rank  # rank r passes r+1 values
        out = m.signatures["serving_default"](x=tf.constant(np.resize(x, 3)))
        equal(out["sum"].numpy(), sum(np.resize(np.arange(r + 1, dtype=np.float32) + 10 * r, 3) for r in range(size)))
        equal(out["rank"].numpy(), np.int32(rank))
        gathered = np.concatenate([np.resize(np.arange(r + 1, dtype=np.float32) + 10 * r, 3) for r in range(size)])
        return equal(out["gathered"].numpy(), gathered)
    check(f"saved model on {size} ranks", run)
    finish(comm)


def unregistered(model_dir):
    import tensorflow as tf

    check("load without the library", lambda: expect_error(
        lambda: tf.saved_model.load(model_dir), (tf.errors.NotFoundError, RuntimeError), "Op type not registered 'Vf"))

    import vfgraph  # noqa: F401
    import vfgraph.ops as ops

    # one process, no mpiexec: a world of one rank, every collective is the identity
    check("single process rank/size", lambda: int(ops.rank()) == 0 and int(ops.size()) == 1)
    x = per_rank(0, (3, 2)).astype(np.float32)
    check("single process allreduce", lambda: equal(ops.allreduce(x).numpy(), x))
    check("single process allreduce half", lambda: equal(ops.allreduce(x.astype(np.float16)).numpy(),
                                                         x.astype(np.float16)))
    check("single process broadcast", lambda: equal(ops.broadcast(x).numpy(), x))
    check("single process allgather", lambda: equal(ops.allgather(x).numpy(), x))
    check("single process check", lambda: ops.check("abc", "single") is None)

    @tf.function
    def graph(t):
        return ops.allreduce(t * 1.0)
    check("single process graph allreduce", lambda: equal(graph(tf.constant(x)).numpy(), x))
    finish(None)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    {"collectives": collectives, "load-saved": load_saved, "unregistered": unregistered}[mode](path)
