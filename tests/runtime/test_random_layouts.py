"""Random ops keyed by virtual node, on every layout: the four models of test_random_ops
(Keras ``Dropout``, a keras-hub transformer with dropout, an in-graph random augmentation, a
``tf.random.Generator``) draw the same values with the V=8 virtual nodes on one process (1x8),
on 2 ranks (2x4, 5+3), through an elastic 1 -> 2 -> 1 run, over the replicas of a pipeline,
and fed one call at a time through the step-wise signatures.

(Each MPI run costs seconds: a model's layouts share one test, and the models are those
test_random_ops exports, made once per pytest process.)"""
import numpy as np
import pytest

from test_mpi_train import B, run_train
from test_random_ops import STEPS, assert_identical, made, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.mpi


def test_pipeline_replicas_draw_what_the_unstaged_step_draws(made, reference, digits, tmp_path):
    """2 stages x 2 replicas (mpiexec -n 4): each replica numbers its virtual nodes after the
    lower replica's (an all-gather over the ranks of its stage), so the deterministic staged
    step trains bit-identical to the unstaged one on one process."""
    import vfgraph

    staged = str(tmp_path / "staged")
    vfgraph.save(vfgraph.rewrite(made("dropout"), vnodes=8, vnode_batch=B, stages=2, deterministic=True), staged)
    run_train(4, staged, digits["train"], str(tmp_path / "replicas"), STEPS, "--threads", "1")
    assert_identical(reference("dropout"), str(tmp_path / "replicas"), "2 stages x 2 replicas")
