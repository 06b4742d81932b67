"""The formats vfgraph reads are one ordered list (vfgraph.io.formats): each listed once, each
recognising its own files and no other's, a format added to the list read by ``vfgraph.load``
and ``vfgraph rewrite`` as it is, and a path no format reads refused with the list."""
import os
import shutil

import pytest

import vfgraph
from vfgraph.errors import InputError
from vfgraph.io import formats, graphdef
from vfgraph.testing.cli import one_error, run_in_process, tree_digest

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_TEXT = os.path.join(HERE, "goldens", "split-vnodes", "matmul_sgd.before.pbtxt")


@pytest.fixture(scope="module")
def samples(models, tmp_path_factory):
    """A small real model of each format, by the format's name: (path, ...)."""
    import keras
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    root = tmp_path_factory.mktemp("formats")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), name="x"), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.save(root / "tiny.keras")
    loaded = tf.saved_model.load(models("mlp:sgd"))
    gd = convert_variables_to_constants_v2(loaded.signatures["serving_default"]).graph.as_graph_def()
    tf.io.write_graph(gd, str(root), "mlp.pb", as_text=False)
    tf.io.write_graph(gd, str(root), "mlp.pbtxt", as_text=True)
    meta = models("tf1ckpt:momentum")
    return {"keras": [str(root / "tiny.keras")],
            "saved-model": [models("mlp:sgd")],
            "tf1": [meta, os.path.dirname(meta)],
            "saved-model-text": [GOLDEN_TEXT],
            "graph-def": [str(root / "mlp.pb"), str(root / "mlp.pbtxt")]}


@pytest.fixture
def registered():
    """Registers formats for one test and takes them off after it."""
    added = []

    def register(fmt, before=None):
        added.append(formats.register(fmt, before))
        return fmt

    yield register
    for fmt in added:
        formats.unregister(fmt.name)


def _graph_def_as(suffix):
    """A real format for the test: a frozen binary GraphDef in a file named ``*<suffix>``."""
    return formats.Format("graph-def" + suffix, f"a frozen GraphDef named *{suffix}", "a frozen GraphDef",
                          lambda p: p.endswith(suffix) and os.path.isfile(p), graphdef.load_graph_def, ("outputs",))


def test_each_format_is_listed_once():
    listed = formats.registered()
    names = [f.name for f in listed]
    assert names == ["keras", "saved-model", "tf1", "saved-model-text", "graph-def"]
    assert len({f.description for f in listed}) == len(listed)
    assert all(isinstance(f, formats.Format) and f.description and f.kind for f in listed)


def test_each_format_recognises_its_own_samples_and_no_other(samples):
    assert set(samples) == {f.name for f in formats.registered()}
    for fmt in formats.registered():
        for owner, paths in samples.items():
            for path in paths:
                assert fmt.sniff(path) == (fmt.name == owner), (fmt.name, path)
    for owner, paths in samples.items():
        for path in paths:
            assert formats.format_of(path).name == owner, path


def test_a_path_of_no_format_is_recognised_by_none(tmp_path):
    """A missing path, an empty directory, a text file, a .pbtxt of nothing: every format says no."""
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty.pbtxt").write_text("")
    for path in (tmp_path / "missing.pb", tmp_path, tmp_path / "notes.txt"):
        assert [f.name for f in formats.registered() if f.sniff(str(path))] == [], path
    assert formats.format_of(str(tmp_path / "empty.pbtxt")).name == "graph-def"  # by its name; read, it is refused


def test_a_registered_format_is_read_by_load_and_rewrite(samples, registered, tmp_path, capsys):
    """A format added to the list (a GraphDef named *.graph) is read by vfgraph.load and by
    vfgraph rewrite, as the same GraphDef named *.pb is, with nothing else changed."""
    src = tmp_path / "mlp.graph"
    shutil.copyfile(samples["graph-def"][0], src)
    with pytest.raises(InputError, match="not a model vfgraph can read"):
        vfgraph.load(src)
    registered(_graph_def_as(".graph"), before="graph-def")
    item, same = vfgraph.load(src), vfgraph.load(samples["graph-def"][0])
    assert (item.kind, sorted(item.signatures)) == (same.kind, sorted(same.signatures)) == ("graph_def", ["graph"])
    assert item.meta_graph.graph_def == same.meta_graph.graph_def
    before = tree_digest(tmp_path)
    code, err = run_in_process(capsys, "rewrite", src, "--vnode-batch", 4, "-o", tmp_path / "out.pb")
    assert code == 0, err
    assert vfgraph.load(tmp_path / "out.pb").signatures["graph"]
    os.remove(tmp_path / "out.pb")
    assert tree_digest(tmp_path) == before  # the input untouched
    code, err = run_in_process(capsys, "rewrite", src, "--vnode-batch", 4, "--loss", "loss:0", "-o",
                               tmp_path / "out2.pb")
    one_error(code, err, f"{src}: --loss names a TF1 MetaGraphDef's loss tensor, and this is a frozen GraphDef")


def test_unknown_input_lists_the_registered_formats(registered, tmp_path, capsys):
    registered(_graph_def_as(".graph"))
    inputs = tmp_path / "in"
    inputs.mkdir()
    notes = inputs / "notes.txt"
    notes.write_text("not a model")
    for path in (notes, inputs):
        code, err = run_in_process(capsys, "rewrite", path, "--vnodes", 2, "-o", tmp_path / "out")
        line = one_error(code, err, f"{path}: not a model vfgraph can read; give ")
        listed = [f.description for f in formats.registered()]
        assert listed[-1] == "a frozen GraphDef named *.graph"
        positions = [line.index(d) for d in listed]
        assert positions == sorted(positions), line
    assert not os.path.exists(tmp_path / "out")


def test_registering_refuses_a_name_twice_or_an_unknown_place(registered):
    registered(_graph_def_as(".x"))
    with pytest.raises(ValueError, match="a format named 'graph-def.x' is registered already"):
        formats.register(_graph_def_as(".x"))
    with pytest.raises(ValueError, match="no format named 'nothing'"):
        formats.register(_graph_def_as(".y"), before="nothing")
    assert [f.name for f in formats.registered()][-2:] == ["graph-def", "graph-def.x"]
