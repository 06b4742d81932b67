"""The real-architecture corpus (examples/corpus.py): models written by keras-hub,
keras.applications, Keras layers and TensorFlow's TF1 API, each rewritten and checked
(vfgraph/testing/corpus.py says what is checked)."""
import pytest

import corpus
from vfgraph.testing.corpus import check_model


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(corpus.CORPUS))
def test_corpus_model(name, exported, tmp_path, c_client):
    e = corpus.CORPUS[name]
    res = check_model(name, exported(name), str(tmp_path), corpus.sample, optimizer=e.optimizer,
                      batch_stats=e.batch_stats, dropout=e.dropout, tags=list(e.tags) or None,
                      sgd_variant=lambda: exported(name, "sgd"), c_api_client=c_client, train_save=e.train_save)
    assert not res.refused, res.refused
    if e.train_save:  # vfgraph train: the trained model and its serving export load in a fresh process and serve
        assert not res.trained_problem, res.trained_problem
        assert res.trained_error < 1e-5 and res.trained_export_error < 1e-5, res
    assert res.serving_error is not None and res.serving_error < 1e-5, res
    assert res.fresh_load, res.fresh_error
    if not e.tags:  # the serving export: no vfgraph needed, in Python and in the C API
        assert not res.export_problem, res.export_problem
        assert res.export_error < 1e-5 and res.export_c_api_error < 1e-5, res
    if e.optimizer and not e.tags:
        # batch norm: Grappler's arithmetic optimizer reassociates the original graph's gradient
        # arithmetic across what becomes the cut; with it off, V=1 is bit-identical there too
        exact = res.v1_identical or (e.batch_stats and res.v1_identical_without_arithmetic and res.v1_error < 1e-3)
        assert exact, f"V=1 differs from the original in {res.v1_differing[:5]} ({res.v1_error})"
        assert res.v4_error is not None and res.v4_error < 1e-5, (res.v4_reference, res.v4_error)
