"""A corpus of real architectures, written by libraries (keras-hub, keras.applications, Keras
layers, TensorFlow's TF1 API), in small configurations that export and train on a CPU in
seconds, each exported in the conventions vfgraph reads: a tf.Module with a 'train' signature
(one optimizer step on a batch dict, returning {"loss": ...}) and a 'serving_default' signature,
or an inference-only Keras ``model.export()``.

    python examples/corpus.py list
    python examples/corpus.py NAME OUT_DIR [--optimizer sgd|momentum|adam|adamw]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # export.py beside this file

SEQ = 8       # tokens per example for the language models
VOCAB = 96    # vocabulary of the language models
IMAGE = 32    # image side for the vision models


@dataclass(frozen=True)
class Entry:
    """One corpus model: how it is built, what it exercises, its optimizer by default."""

    build: Callable[..., None]  # build(out, optimizer) writes the SavedModel
    family: str
    optimizer: str              # "" for inference-only exports
    batch_stats: bool = False   # batch norm: per-virtual-node statistics change the step
    dropout: bool = False       # random masks per virtual node change the step
    tags: tuple = ()            # MetaGraph tags to load (TF1 SavedModels)
    training: tuple = ()        # training options: (Keras optimizer option, value), ("loss", "sum")
    train_save: bool = False    # also trained with vfgraph train, saved, served and resumed
    note: str = ""


def training_spec(optimizer: str, training: tuple = ()) -> str:
    """``optimizer`` with the training options ``training`` ((key, value) pairs: a Keras optimizer
    option, or ``loss`` "sum"), as one string: "adam:global_clipnorm=0.05,loss=sum"."""
    return optimizer + (":" + ",".join(f"{k}={v}" for k, v in training) if training else "")


def _parse_spec(spec: str):
    """(optimizer name, its Keras options, the loss's reduction over the batch) of a training_spec."""
    name, _, rest = spec.partition(":")
    options = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    reduction = options.pop("loss", "mean")
    return name, {k: _value(v) for k, v in options.items()}, reduction


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    return float(text) if any(c in text for c in ".e") else int(text)


def _optimizer(spec: str, lr: float):
    import keras

    name, options, _ = _parse_spec(spec)
    return {"sgd": lambda: keras.optimizers.SGD(lr, **options),
            "momentum": lambda: keras.optimizers.SGD(lr, momentum=0.9, **options),
            "adam": lambda: keras.optimizers.Adam(lr, **options),
            "adamw": lambda: keras.optimizers.AdamW(lr, weight_decay=0.01, **options)}[name]()


def _save(out: str, model, features: Dict[str, object], labels, loss_fn, optimizer: str, lr: float,
          serve_key: str = "logits") -> None:
    """Write ``model`` as a training SavedModel: 'train' takes {features..., "labels"} and applies
    one step of ``optimizer``; 'serving_default' takes the features and returns the model's output."""
    import tensorflow as tf

    specs = dict(features, labels=labels)
    single = len(features) == 1
    if _parse_spec(optimizer)[2] == "sum":  # the per-example losses summed over the batch, not averaged
        loss_fn = _ce_sum if loss_fn is _ce else loss_fn

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.model_variables = list(model.variables)  # Keras state outside tf.Module tracking
            self.opt = _optimizer(optimizer, lr)
            self.opt.build(model.trainable_variables)

        def _call(self, batch, training):
            x = next(iter(batch.values())) if single else batch
            return model(x, training=training)

        @tf.function(input_signature=[specs])
        def train(self, batch):
            feats = {k: batch[k] for k in features}
            with tf.GradientTape() as tape:
                loss = loss_fn(batch["labels"], self._call(feats, True))
            grads = tape.gradient(loss, model.trainable_variables)
            self.opt.apply_gradients(zip(grads, model.trainable_variables))
            return {"loss": loss}

        @tf.function(input_signature=[dict(features)])
        def serve(self, batch):
            return {serve_key: self._call(batch, False)}

    m = Trainer()
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})


def _ce(labels, logits):
    import tensorflow as tf

    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def _ce_sum(labels, logits):
    import tensorflow as tf

    return tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def _tokens(*names: str) -> Dict[str, object]:
    import tensorflow as tf

    return {n: tf.TensorSpec([None, SEQ], tf.int32, name=n) for n in names}


def _token_labels():
    import tensorflow as tf

    return tf.TensorSpec([None, SEQ], tf.int32, name="labels")


def _class_labels():
    import tensorflow as tf

    return tf.TensorSpec([None], tf.int32, name="labels")


def _seed():
    import keras

    keras.utils.set_random_seed(0)


def _causal_lm(out: str, optimizer: str, lm, lr: float = 0.01) -> None:
    _save(out, lm, _tokens("token_ids", "padding_mask"), _token_labels(), _ce, optimizer, lr)


def gpt2(out: str, optimizer: str = "adam") -> None:
    """GPT-2 causal LM: learned positions, LayerNorm, the token embedding tied to the output
    projection (the variable gets a sparse gradient from the lookup and a dense one from the head)."""
    import keras_hub

    _seed()
    bb = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, dropout=0.0, max_sequence_length=16)
    _causal_lm(out, optimizer, keras_hub.models.GPT2CausalLM(bb, preprocessor=None))


def llama(out: str, optimizer: str = "sgd") -> None:
    """Llama causal LM: rotary embeddings, RMSNorm, grouped-query attention, gated (SwiGLU)
    feed-forward, untied output head."""
    import keras_hub

    _seed()
    bb = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, hidden_dim=16,
                                        intermediate_dim=32, num_key_value_heads=2)
    _causal_lm(out, optimizer, keras_hub.models.LlamaCausalLM(bb, preprocessor=None), lr=0.1)


def mixtral(out: str, optimizer: str = "momentum") -> None:
    """Mixtral causal LM: a sparse mixture of experts (4 experts, top 2) in every layer."""
    import keras_hub

    _seed()
    bb = keras_hub.models.MixtralBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, hidden_dim=16,
                                          intermediate_dim=32, num_key_value_heads=2, num_experts=4, top_k=2)
    _causal_lm(out, optimizer, keras_hub.models.MixtralCausalLM(bb, preprocessor=None), lr=0.05)


def gemma(out: str, optimizer: str = "adamw") -> None:
    """Gemma causal LM: RMSNorm, multi-query attention, GeGLU, embedding tied to the head."""
    import keras_hub

    _seed()
    bb = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)
    _causal_lm(out, optimizer, keras_hub.models.GemmaCausalLM(bb, preprocessor=None))


def bert(out: str, optimizer: str = "adamw") -> None:
    """BERT encoder with a classifier on the pooled output; dropout 0.1 as BERT trains."""
    import keras
    import keras_hub

    _seed()
    bb = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, max_sequence_length=16, dropout=0.1)
    feats = {k: keras.Input((SEQ,), dtype="int32", name=k) for k in ("token_ids", "segment_ids", "padding_mask")}
    logits = keras.layers.Dense(3)(bb(feats)["pooled_output"])
    _save(out, keras.Model(feats, logits), _tokens("token_ids", "segment_ids", "padding_mask"), _class_labels(),
          _ce, optimizer, 0.005)


def roberta(out: str, optimizer: str = "momentum") -> None:
    """RoBERTa encoder, mean-pooled, with a classifier."""
    import keras
    import keras_hub

    _seed()
    bb = keras_hub.models.RobertaBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                          intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    feats = {k: keras.Input((SEQ,), dtype="int32", name=k) for k in ("token_ids", "padding_mask")}
    logits = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(bb(feats)))
    _save(out, keras.Model(feats, logits), _tokens("token_ids", "padding_mask"), _class_labels(), _ce, optimizer, 0.05)


def bart(out: str, optimizer: str = "sgd") -> None:
    """BART encoder-decoder as a sequence-to-sequence LM (cross-attention, tied embeddings)."""
    import keras_hub

    _seed()
    bb = keras_hub.models.BartBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    lm = keras_hub.models.BartSeq2SeqLM(bb, preprocessor=None)
    feats = _tokens("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")
    _save(out, lm, feats, _token_labels(), _ce, optimizer, 0.1)


def _image_spec():
    import tensorflow as tf

    return {"images": tf.TensorSpec([None, IMAGE, IMAGE, 3], tf.float32, name="images")}


def _classifier(backbone_out, classes: int = 10):
    import keras

    if len(backbone_out.shape) == 4:
        backbone_out = keras.layers.GlobalAveragePooling2D()(backbone_out)
    return keras.layers.Dense(classes)(backbone_out)


def _vision_transformer(out: str, optimizer: str, lr: float, backbone: str, **config) -> None:
    """A keras-hub vision-transformer backbone with a classifier on its first (class) token."""
    import keras
    import keras_hub

    _seed()
    bb = getattr(keras_hub.models, backbone)(image_shape=(IMAGE, IMAGE, 3), patch_size=8, num_layers=2, num_heads=2,
                                             hidden_dim=16, **config)
    x = keras.Input((IMAGE, IMAGE, 3))
    _save(out, keras.Model(x, keras.layers.Dense(10)(bb(x)[:, 0])), _image_spec(), _class_labels(), _ce, optimizer, lr)


def vit(out: str, optimizer: str = "momentum") -> None:
    """Vision transformer: patch embedding, a class token broadcast to the batch, learned positions."""
    _vision_transformer(out, optimizer, 0.05, "ViTBackbone", mlp_dim=32)


def resnet_hub(out: str, optimizer: str = "momentum") -> None:
    """keras-hub ResNet (basic blocks, batch norm)."""
    import keras
    import keras_hub

    _seed()
    bb = keras_hub.models.ResNetBackbone(input_conv_filters=[64], input_conv_kernel_sizes=[3],
                                         stackwise_num_filters=[64, 64], stackwise_num_blocks=[1, 1],
                                         stackwise_num_strides=[1, 2], block_type="basic_block",
                                         image_shape=(IMAGE, IMAGE, 3))
    x = keras.Input((IMAGE, IMAGE, 3))
    _save(out, keras.Model(x, _classifier(bb(x))), _image_spec(), _class_labels(), _ce, optimizer, 0.05)


def _application(app: str, out: str, optimizer: str, lr: float = 0.05, **kw) -> None:
    import keras

    _seed()
    model = getattr(keras.applications, app)(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=10,
                                             classifier_activation=None, **kw)
    _save(out, model, _image_spec(), _class_labels(), _ce, optimizer, lr)


def mobilenet_v2(out: str, optimizer: str = "sgd") -> None:
    """keras.applications MobileNetV2 (alpha 0.35): depthwise convolutions, batch norm, ReLU6."""
    _application("MobileNetV2", out, optimizer, alpha=0.35)


def efficientnet_b0(out: str, optimizer: str = "adam") -> None:
    """keras.applications EfficientNetB0: an input Normalization layer holding mean and variance,
    squeeze-and-excitation, drop-connect and dropout, batch norm."""
    _application("EfficientNetB0", out, optimizer, lr=0.001)


def gru(out: str, optimizer: str = "adam") -> None:
    """A recurrent text classifier: Embedding, bidirectional GRU, Dense (Keras layers)."""
    import keras

    _seed()
    model = keras.Sequential([keras.Input((SEQ,), dtype="int32"), keras.layers.Embedding(VOCAB, 8),
                              keras.layers.Bidirectional(keras.layers.GRU(8)), keras.layers.Dense(3)])
    _save(out, model, _tokens("token_ids"), _class_labels(), _ce, optimizer, 0.01)


def mobilenet_v3_export(out: str, optimizer: str = "") -> None:
    """keras.applications MobileNetV3Small written by Keras 3's ``model.export()`` (inference only)."""
    import keras

    _seed()
    model = keras.applications.MobileNetV3Small(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=10,
                                                include_preprocessing=True)
    model.export(out, verbose=False)


def tf1_serve_train(out: str, optimizer: str = "momentum") -> None:
    """A TF1 graph (tf.compat.v1: placeholders, batch norm from moments with moving averages
    under control dependencies, Momentum) saved with tags serve, train: its 'train' signature
    returns the loss and the update is the train op of the collection."""
    import export

    export.tf1_serve_train(out, optimizer=optimizer)


def tf1_builder(out: str, optimizer: str = "momentum") -> None:
    """A TF1 graph (tf.compat.v1: placeholders, reference variables, batch norm from moments with
    moving averages under control dependencies, Momentum) saved with the SavedModel builder, tag
    serve: its 'train' signature returns the loss after the train op."""
    import export

    export.tf1_momentum_bn(out, optimizer=optimizer, resource=False)


def qwen3(out: str, optimizer: str = "adamw") -> None:
    """Qwen3 causal LM: query/key RMSNorm, grouped-query attention, tied embedding."""
    import keras_hub

    _seed()
    bb = keras_hub.models.Qwen3Backbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                                        head_dim=8, hidden_dim=16, intermediate_dim=32)
    _causal_lm(out, optimizer, keras_hub.models.Qwen3CausalLM(bb, preprocessor=None))


def mistral(out: str, optimizer: str = "sgd") -> None:
    """Mistral causal LM: sliding-window attention, rotary embeddings, GQA."""
    import keras_hub

    _seed()
    bb = keras_hub.models.MistralBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, hidden_dim=16,
                                          intermediate_dim=32, num_key_value_heads=2, sliding_window=4)
    _causal_lm(out, optimizer, keras_hub.models.MistralCausalLM(bb, preprocessor=None), lr=0.1)


def qwen_moe(out: str, optimizer: str = "momentum") -> None:
    """Qwen-MoE causal LM: routed experts beside a shared expert."""
    import keras_hub

    _seed()
    bb = keras_hub.models.QwenMoeBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                                          hidden_dim=16, intermediate_dim=32, moe_intermediate_dim=16,
                                          shared_expert_intermediate_dim=16, num_experts=4, top_k=2)
    _causal_lm(out, optimizer, keras_hub.models.QwenMoeCausalLM(bb, preprocessor=None), lr=0.05)


def t5(out: str, optimizer: str = "adam") -> None:
    """T5 encoder-decoder: relative position buckets, gated activation, tied embedding; a
    token classifier on the decoder's output."""
    import keras
    import keras_hub

    _seed()
    bb = keras_hub.models.T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                                     intermediate_dim=32, key_value_dim=8, dropout=0.0)
    names = ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")
    feats = {k: keras.Input((SEQ,), dtype="int32", name=k) for k in names}
    logits = keras.layers.Dense(VOCAB)(bb(feats)["decoder_sequence_output"])
    _save(out, keras.Model(feats, logits), _tokens(*names), _token_labels(), _ce, optimizer, 0.01)


def distilbert(out: str, optimizer: str = "sgd") -> None:
    """DistilBERT encoder with a classifier on the first token."""
    import keras
    import keras_hub

    _seed()
    bb = keras_hub.models.DistilBertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    feats = {k: keras.Input((SEQ,), dtype="int32", name=k) for k in ("token_ids", "padding_mask")}
    _save(out, keras.Model(feats, keras.layers.Dense(3)(bb(feats)[:, 0])), _tokens("token_ids", "padding_mask"),
          _class_labels(), _ce, optimizer, 0.05)


def deit(out: str, optimizer: str = "adamw") -> None:
    """DeiT: a vision transformer with class and distillation tokens."""
    _vision_transformer(out, optimizer, 0.005, "DeiTBackbone", intermediate_dim=32)


def densenet121(out: str, optimizer: str = "sgd") -> None:
    """keras.applications DenseNet121: dense concatenations, batch norm."""
    _application("DenseNet121", out, optimizer)


def resnet50_v2(out: str, optimizer: str = "momentum") -> None:
    """keras.applications ResNet50V2: pre-activation residual blocks."""
    _application("ResNet50V2", out, optimizer)


def efficientnet_v2_b0(out: str, optimizer: str = "adam") -> None:
    """keras.applications EfficientNetV2B0: fused MBConv, a Rescaling input."""
    _application("EfficientNetV2B0", out, optimizer, lr=0.001)


def convnext_tiny(out: str, optimizer: str = "adamw") -> None:
    """keras.applications ConvNeXtTiny: LayerNorm, layer scale, stochastic depth."""
    _application("ConvNeXtTiny", out, optimizer, lr=0.001)


CORPUS: Dict[str, Entry] = {
    "gpt2": Entry(gpt2, "decoder LM, tied embedding", "adam"),
    "llama": Entry(llama, "decoder LM, rotary, RMSNorm, GQA, gated FFN", "sgd"),
    "mixtral": Entry(mixtral, "decoder LM, mixture of experts", "momentum"),
    "gemma": Entry(gemma, "decoder LM, MQA, GeGLU, tied embedding", "adamw"),
    "bert": Entry(bert, "encoder, classifier", "adamw", dropout=True),
    "roberta": Entry(roberta, "encoder, classifier", "momentum"),
    "bart": Entry(bart, "encoder-decoder seq2seq LM", "sgd"),
    "vit": Entry(vit, "vision transformer", "momentum"),
    "resnet-hub": Entry(resnet_hub, "convolutional backbone, batch norm", "momentum", batch_stats=True),
    "mobilenet-v2": Entry(mobilenet_v2, "keras.applications, depthwise conv, batch norm", "sgd", batch_stats=True),
    "efficientnet-b0": Entry(efficientnet_b0, "keras.applications, Normalization input, SE", "adam",
                             batch_stats=True, dropout=True),
    "gru": Entry(gru, "recurrent, embedding", "adam"),
    "tf1-serve-train": Entry(tf1_serve_train, "TF1 graph, tags serve+train, train op in the collection", "momentum",
                             batch_stats=True, tags=("serve", "train"), train_save=True),
    "tf1-builder": Entry(tf1_builder, "TF1 graph, SavedModel builder, reference variables", "momentum",
                         batch_stats=True, tags=("serve",), train_save=True),
    "roberta-sum": Entry(roberta, "encoder, loss summed over the batch, clipvalue", "momentum",
                         training=(("clipvalue", 0.01), ("loss", "sum"))),
    "bart-sum-clipped": Entry(bart, "encoder-decoder, loss summed, global_clipnorm", "sgd",
                              training=(("global_clipnorm", 0.5), ("loss", "sum"))),
    "mobilenet-v3-export": Entry(mobilenet_v3_export, "keras.applications, model.export(), inference", ""),
}

# More of the same families, for tools/corpus_sweep.py (larger or slower than the tests need).
EXTENDED: Dict[str, Entry] = {
    "qwen3": Entry(qwen3, "decoder LM, QK-norm, GQA, tied embedding", "adamw"),
    "mistral": Entry(mistral, "decoder LM, sliding-window attention", "sgd"),
    "qwen-moe": Entry(qwen_moe, "decoder LM, routed and shared experts", "momentum"),
    "t5": Entry(t5, "encoder-decoder, relative positions", "adam"),
    "distilbert": Entry(distilbert, "encoder, classifier", "sgd"),
    "deit": Entry(deit, "vision transformer, distillation token", "adamw"),
    "densenet121": Entry(densenet121, "keras.applications, dense blocks, batch norm", "sgd", batch_stats=True),
    "resnet50-v2": Entry(resnet50_v2, "keras.applications, pre-activation ResNet", "momentum", batch_stats=True),
    "efficientnet-v2-b0": Entry(efficientnet_v2_b0, "keras.applications, fused MBConv", "adam", batch_stats=True,
                                dropout=True),
    "gru-clipped": Entry(gru, "recurrent, Adam with global_clipnorm", "adam", training=(("global_clipnorm", 0.05),)),
    "vit-ema": Entry(vit, "vision transformer, AdamW with EMA and clipnorm", "adamw",
                     training=(("use_ema", True), ("ema_overwrite_frequency", 2), ("clipnorm", 0.1))),
    "convnext-tiny": Entry(convnext_tiny, "keras.applications, LayerNorm, stochastic depth", "adamw", dropout=True),
}
ALL: Dict[str, Entry] = {**CORPUS, **EXTENDED}


def export(name: str, out: str, optimizer: Optional[str] = None) -> str:
    """Export corpus model ``name`` to ``out`` (with ``optimizer`` instead of its own); returns ``out``."""
    e = ALL[name]
    e.build(out, training_spec(optimizer or e.optimizer, e.training)) if e.optimizer else e.build(out)
    return out


def sample(signature, batch: int, seed: int = 0) -> Dict[str, "object"]:
    """Inputs for a loaded signature: images ~N(0,1), token ids and labels in range, padding
    masks of ones with a padded tail on some rows, segment ids of 0 and 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    _, specs = signature.structured_input_signature
    out = {}
    for key in sorted(specs):
        spec = specs[key]
        shape = [batch if d is None else d for d in spec.shape.as_list()]
        dt = spec.dtype.as_numpy_dtype
        if spec.dtype.is_floating:
            out[key] = rng.normal(size=shape).astype(dt)
        elif key.endswith("padding_mask"):
            lengths = rng.integers(SEQ // 2, SEQ + 1, size=shape[0])
            out[key] = (np.arange(shape[1])[None, :] < lengths[:, None]).astype(dt)
        elif key == "segment_ids":
            out[key] = (np.arange(shape[1])[None, :] >= shape[1] // 2).repeat(shape[0], 0).astype(dt)
        elif key in ("labels", "y") and len(shape) == 1:  # classes (y: the TF1 graphs' labels)
            out[key] = rng.integers(0, 3, size=shape).astype(dt)
        else:  # token ids
            out[key] = rng.integers(0, VOCAB, size=shape).astype(dt)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(ALL) + ["list"])
    p.add_argument("out", nargs="?")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"])
    a = p.parse_args()
    if a.name == "list":
        for k, e in ALL.items():
            print(f"{k:22} {e.family} ({training_spec(e.optimizer, e.training) or 'inference'})")
        return
    if not a.out:
        p.error("OUT_DIR is required")
    print(f"wrote {export(a.name, a.out, a.optimizer)}")


if __name__ == "__main__":
    main()
