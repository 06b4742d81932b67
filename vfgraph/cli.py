"""vfgraph command line: rewrite | inspect | diff | verify | train | export | serve | build-ops."""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import textwrap
import time
import traceback
from typing import Dict, Iterator, List, Optional

import vfgraph
from vfgraph import records
from vfgraph.errors import InputError, Quiet, VfgraphError
from vfgraph.io import outputs
from vfgraph.records import Allreduce, Stages, VirtualNodes
from vfgraph.runtime.supervise import is_worker, launcher_rank, supervise
from vfgraph.runtime.world import agreeing, launched_by_mpi, launched_world
from vfgraph.version import __version__

log = logging.getLogger("vfgraph")
_STARTED = time.time()  # when this command began (a new rank of an elastic job reports its start-up)


def _quiet_tf() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help text wrapped at spaces only: pipeline specs and option names stay whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """A usage mistake (an option's value that is not a number, a missing argument) is one line
    on stderr naming the option and where its help is, exit 2. Under ``mpiexec`` every rank
    reads the same command line and finds the same mistake, before MPI starts: rank 0 says it,
    the others exit 2 quietly."""

    def error(self, message: str):
        if launched_by_mpi() and launcher_rank() not in ("0", "?"):
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


EXIT_CODES = "exit codes: 0 ok, 1 the models differ (diff, verify), 2 a user error (one line says what to do), " \
             "3 an internal error (please report it), 75 train stalled (--stall-timeout), 130 interrupted"


_PASS_COMMANDS = ("rewrite", "inspect")  # the commands with flags made from the passes' options


def _parser(flags_of: Optional[str] = None, parser_class: type = _Parser) -> argparse.ArgumentParser:
    """vfgraph's command line. The flags made from the passes' options (:func:`_pass_flags`)
    are added to command ``flags_of`` only: reading them imports the passes, and TensorFlow
    with them, which the other commands (and a missing input) do without."""
    p = parser_class(prog="vfgraph", formatter_class=_Help, epilog=textwrap.fill(EXIT_CODES, 88), description=(
        "Rewrite exported TensorFlow models: virtual nodes (large batches on small hardware, the same "
        "training on any hardware) and micro-batched serving."))
    p.add_argument("--version", action="version", version=f"vfgraph {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log each step (also accepted after the command)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=description or help, formatter_class=_Help,
                           epilog=textwrap.fill(EXIT_CODES, 88))
        c.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="log each step; on an internal error, print the traceback")
        if name == flags_of:
            _pass_flags(c, name)
        return c

    for add in (_rewrite_command, _inspect_command, _profile_command, _diff_command, _verify_command,
                _train_command, _resize_command, _export_command, _serve_command, _other_commands):
        add(command)
    return p


def _pass_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of command ``command`` (rewrite: every pass's; inspect: partition-stages'
    that plan stages) made from the options that declare them (:func:`vfgraph.passes.base.
    option`), with their type, choices and help; checked by :func:`_check_pass_flags`."""
    from vfgraph.passes.base import flags

    if command not in _PASS_COMMANDS:  # (train reads what a rewrite recorded from the model's records)
        return
    made = flags() if command == "rewrite" else [f for f in flags(["partition-stages"])
                                                 if f.flag not in ("--devices", "--schedule")]
    group = p.add_argument_group("options of the passes", "(the options 'vfgraph passes' lists, as flags)")
    for f in made:
        text = f.help.replace("%", "%%")
        if f.type is bool:
            group.add_argument(f.flag, dest=f.dest, action="store_true", help=text)
        else:
            group.add_argument(f.flag, dest=f.dest, type=f.type, metavar=f.metavar, choices=f.choices, help=text)
    p.set_defaults(pass_flags=tuple(made))


def _rewrite_command(command) -> None:
    r = command("rewrite", "rewrite a model with virtual nodes",
                "Rewrite MODEL so each training step runs as V virtual nodes of b examples (gradients "
                "accumulated, one update), with the all-reduce over MPI ranks, and serving micro-batched. The "
                "input is only read; the output is written whole or not at all.")
    r.add_argument("model", help="SavedModel directory, compiled Keras 3 .keras file, frozen GraphDef (.pb, .pbtxt), "
                                 "or TF1 MetaGraphDef (.meta, or a checkpoint directory) with its checkpoint")
    r.add_argument("-o", "--output", help="output SavedModel directory (a .pb/.pbtxt file for a GraphDef input); "
                                          "default: MODEL_vnodesV beside MODEL")
    r.add_argument("--pipeline", help="pass pipeline instead of the default one, e.g. "
                                      "'split-vnodes{vnodes=8},microbatch-inference' (then give V and b there, "
                                      "not with --vnodes and --vnode-batch)")
    r.add_argument("--print-after-all", action="store_true", help="print the canonical graph after each pass")
    r.add_argument("--verify-each", action="store_true",
                   help="verify the model after every pass, not only at the end (names the pass that broke it)")
    r.add_argument("--force", action="store_true",
                   help="replace OUTPUT if it exists and vfgraph wrote it (anything else is never replaced)")
    r.add_argument("--outputs", metavar="T1,T2",
                   help="frozen GraphDefs: comma-separated output tensors (default: the nodes nothing consumes)")
    r.add_argument("--allreduce", choices=("mpi", "none"),
                   help="data-parallel all-reduce over MPI ranks in a TF2 training step (default mpi: the same "
                        "output on every machine; loading it needs vfgraph's ops, so serve a 'vfgraph export' of it; "
                        "none: no collectives)")
    _tf1_options(r)
    _keras_options(r, fine_tune=True)


def _inspect_command(command) -> None:
    i = command("inspect", "show what vfgraph detects in a model",
                "Show what vfgraph detects in MODEL; with --stages (or --split-at), also plan cutting the training "
                "step into K pipeline stages: forward and backward ops, variables, optimizer state, estimated FLOPs "
                "per stage and the bytes crossing each cut.")
    i.add_argument("model", help="a model, as for 'rewrite'")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    _tf1_options(i)
    _keras_options(i, fine_tune=True)


def _profile_command(command) -> None:
    pr = command("profile", "time each op of a model's training step here, for --stages with --profile",
                 "Run MODEL's training step on a synthetic batch (normal floats, zero integers, true booleans) in "
                 "TensorFlow on this machine's CPU, one thread, and write each op's median time to OUTPUT, a JSON "
                 "file that 'vfgraph rewrite' and 'vfgraph inspect' take with --stages K --profile OUTPUT: profile "
                 "once where the model will train, rewrite anywhere, the same rewrite from the same file. MODEL and "
                 "its files are only read.")
    pr.add_argument("model", help="SavedModel directory with a training signature")
    pr.add_argument("-o", "--output", required=True, help="the profile's file (.json)")
    pr.add_argument("--batch", type=int, default=32, metavar="N",
                    help="examples in the profiled step's batch: a virtual node's batch, as the stages will run it "
                         "(default 32)")
    pr.add_argument("--steps", type=int, default=10, metavar="N",
                    help="timed steps, after 3 untimed ones; each op's time is its median (default 10)")
    pr.add_argument("--train-signature", default="", metavar="NAME",
                    help="the training signature (default: 'train', or the one found)")
    pr.add_argument("--force", action="store_true", help="replace OUTPUT if it is a profile vfgraph wrote")


def _diff_command(command) -> None:
    d = command("diff", "canonical unified diff of two models, variables included (exit 1 when they differ)",
                "Unified diff of the canonical graphs of A and B, then of their variables' values (exit 1 when they "
                "differ). The graphs are compared as what they compute, not as when they were made: the numbers "
                "tracing puts in function names (__inference_train_123, and vfgraph's __vf_inference_train_123_"
                "reduce made from it) are dropped, functions left with one name are told apart by a digest of "
                "their content, tf.custom_gradient op types (CustomGradient-N) are numbered in order of use, and "
                "nodes are in topological order without debug info; node and argument names are compared as they "
                "are.")
    d.add_argument("a", help="a model, as for 'rewrite'")
    d.add_argument("b", help="the model to compare it with")
    d.add_argument("--graphs-only", action="store_true",
                   help="compare the canonical graphs only (generated names ignored, as above), not the variables")


def _verify_command(command) -> None:
    v = command("verify", "run original and rewritten models on the same inputs and compare (exit 1 on a mismatch)",
                "Run ORIGINAL and REWRITTEN on the same inputs: serving outputs, then --steps training steps, and "
                "compare the parameters (exit 1 when they differ beyond --rtol, or an output or parameter is NaN or "
                "infinite). A rewrite of V>1 virtual nodes of a model with batch statistics (batch norm) differs by "
                "design, and the report says so: compare a --vnodes 1 rewrite instead. Random inputs (without "
                "--data) have integers in [0, 10); a model that takes fewer classes or ids needs --data.")
    v.add_argument("original", help="the original SavedModel")
    v.add_argument("rewritten", help="its rewrite")
    v.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    v.add_argument("--batch-size", type=int, default=32,
                   help="examples per step (default 32; a multiple of the rewrite's virtual-node batch)")
    v.add_argument("--data", help=".npz with the signature's inputs (default: random inputs)")
    v.add_argument("--train-signature", default="train", metavar="NAME", help="the training signature (default train)")
    v.add_argument("--rtol", type=float, default=1e-5,
                   help="largest relative parameter difference accepted (default 1e-5)")


def _train_command(command) -> None:
    t = command("train", "train a SavedModel on arrays from an .npz file, TFRecord or ArrayRecord files",
                "Train MODEL for --steps global batches and write the trained model to OUTPUT (and, to serve, "
                "OUTPUT.serving/1/). Checkpoints go to OUTPUT.ckpt; Ctrl-C (or SIGTERM) stops after the step in "
                "progress with a checkpoint, and --resume continues from it. Under mpiexec every rank trains its "
                "share of each global batch.")
    t.add_argument("model", help="SavedModel directory with a training signature (rewritten or not), or a compiled "
                                 ".keras file (trained as it is: its step built as 'vfgraph rewrite' builds it)")
    t.add_argument("--data", required=True, help=".npz whose array names match the training signature's inputs, "
                   "or TFRecord or ArrayRecord files (.tfrecord, .array_record, or a glob) of tf.train.Example "
                   "records with those features (read by index: each rank reads only its examples)")
    t.add_argument("--input-fn", metavar="MODULE:FUNCTION", help="decode and augment each training example with "
                   "FUNCTION(features, rng) of MODULE (a module name or a .py file): it gets a record's features "
                   "by name and a numpy Generator keyed by (--seed, step, example), and returns the signature's "
                   "inputs for the example (docs/data.md)")
    t.add_argument("--steps", type=int, required=True, help="training steps (global batches) in all, at least 1")
    t.add_argument("--batch-size", type=int, required=True,
                   help="global batch per step: a multiple of the model's virtual-node batch b")
    t.add_argument("-o", "--output", required=True, help="directory for the trained SavedModel")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue from the checkpoint in OUTPUT.ckpt (refused if the options, data or model "
                           "changed); with no checkpoint, start at step 0")
    mode.add_argument("--force", action="store_true",
                      help="replace OUTPUT (and discard an unfinished run's checkpoint) if vfgraph wrote them")
    t.add_argument("--train-signature", default="train", metavar="NAME", help="the training signature (default train)")
    t.add_argument("--checkpoint-every", type=int, default=100, metavar="N",
                   help="write a checkpoint every N steps (default 100; 0: only when stopped)")
    t.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--allow-nonfinite", action="store_true",
                   help="train on when the loss or the parameters are NaN or infinite (default: stop, keeping the "
                        "last checkpoint and writing no model)")
    t.add_argument("--vnodes-per-rank", metavar="V1,V2,...|auto", help="under mpiexec: virtual nodes of each rank, "
                   "e.g. 5,3, or auto: shares planned from each rank's measured speed, again when it drifts by "
                   "more than 10%% (for ranks on uneven hardware; default: the global batch's virtual nodes split "
                   "evenly)")
    _elastic_options(t)
    _report_options(t)
    _keras_options(t)
    t.add_argument("--threads", type=int, help="TensorFlow intra-op threads per rank, with one inter-op thread "
                   "(default: the CPUs a rank is bound to, or this host's CPUs divided by the ranks on it)")


def _report_options(t: argparse.ArgumentParser) -> None:
    """train's validation and TensorBoard options."""
    t.add_argument("--eval-data", metavar="PATH", help="validation data (.npz, or TFRecord files) with the serving "
                   "signature's inputs and the labels the training signature takes: the serving signature is "
                   "validated on it after the last step (and every --eval-every steps), each rank its share; the "
                   "loss and accuracy (integer labels) are logged and shown in the closing line")
    t.add_argument("--eval-every", type=int, metavar="N", help="with --eval-data: validate every N steps too")
    t.add_argument("--logdir", metavar="DIR", help="write TensorBoard event files under DIR/train and "
                   "DIR/validation (batch_loss, epoch_loss, epoch_accuracy, examples/s, step time and virtual nodes "
                   "per rank, learning rate, the graph)")


def _elastic_options(t: argparse.ArgumentParser) -> None:
    """train's options of a job under mpiexec: elastic ranks and the waits for other ranks."""
    t.add_argument("--max-ranks", type=int, metavar="N", help="elastic run: the most ranks the job may grow to "
                   "(with --elastic-schedule)")
    t.add_argument("--elastic-schedule", metavar="STEP:RANKS,...", help="elastic run under mpiexec: change the "
                   "number of ranks at these steps, e.g. 0:1,5:2,10:4,15:2 (start with mpiexec -n RANKS of step 0); "
                   "new ranks are started ahead and load the model while the job trains on")
    t.add_argument("--host-discovery-script", metavar="CMD", help="elastic run: a command that prints the hosts "
                   "available, one per line as HOST or HOST:SLOTS; run every --discovery-interval seconds, the job "
                   "resizes to its slots (at most --max-ranks)")
    t.add_argument("--discovery-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often to run --host-discovery-script (default 5)")
    t.add_argument("--stall-warning", type=float, default=60.0, metavar="SECONDS",
                   help="under mpiexec: a rank waiting longer than this for other ranks (a message, a collective) "
                        "prints one line naming what it waits for and the ranks it waits for (default 60; 0: never)")
    t.add_argument("--stall-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="under mpiexec: a wait for other ranks with no progress for this long ends the job with exit "
                        "code 75, keeping the last checkpoint for --resume (default 600; 0: wait for ever)")
    t.add_argument("--elastic-join", action="store_true", help=argparse.SUPPRESS)


def _resize_command(command) -> None:
    z = command("resize", "ask a running elastic job (vfgraph train --max-ranks N --elastic-schedule ...) for "
                          "another number of ranks: it takes the request at its next step or refuses it, and logs "
                          "which")
    z.add_argument("output", help="the job's output directory (its -o OUTPUT)")
    z.add_argument("ranks", type=int, help="the number of ranks to run on (1..the job's --max-ranks)")


def _export_command(command) -> None:
    e = command("export", "write a serving-only SavedModel (TF Serving's OUTPUT/VERSION/ layout) that TensorFlow "
                          "serves without vfgraph")
    e.add_argument("model", help="SavedModel directory (an original model or a rewritten one), or a .keras file")
    e.add_argument("-o", "--output", required=True, help="base directory; the model is written to OUTPUT/VERSION/")
    e.add_argument("--version", type=int, default=1, help="version directory under OUTPUT (default 1)")
    e.add_argument("--vnode-batch", type=int, default=0, metavar="B",
                   help="serve in slices of at most B examples (default 0: the model's own b, if it has one)")
    e.add_argument("--force", action="store_true",
                   help="replace OUTPUT/VERSION if it exists and vfgraph wrote it")
    _keras_options(e)


def _serve_command(command) -> None:
    """serve, with TF Serving's own spellings of its options accepted as aliases."""
    s = command("serve", "serve the newest version under BASE_PATH with TF Serving's REST and gRPC APIs",
                "Serve model versions BASE_PATH/1/, BASE_PATH/2/, ... (as 'vfgraph export' writes them, or any TF2 "
                "SavedModel with a serving signature) with TF Serving's REST API (/v1/models/NAME...) and gRPC API "
                "(PredictionService.Predict and GetModelMetadata, ModelService.GetModelStatus): the newest version "
                "is served, new ones are picked up while serving, the old one answers its requests first. SIGTERM "
                "or Ctrl-C: requests in flight are answered, then exit 0. TF Serving's flag names are accepted too.")
    s.add_argument("base_path", nargs="?", metavar="BASE_PATH", help="the directory of numbered versions")
    s.add_argument("--model-base-path", "--model_base_path", dest="model_base_path", metavar="BASE_PATH",
                   help="the same as BASE_PATH (TF Serving's flag)")
    s.add_argument("--model-name", "--model_name", default="default", metavar="NAME",
                   help="the model's name in requests (default 'default', as TF Serving)")
    s.add_argument("--rest-port", "--rest_api_port", type=int, default=8501, metavar="PORT",
                   help="REST API port (default 8501; 0: any free port, printed when ready)")
    s.add_argument("--grpc-port", "--port", type=int, default=8500, metavar="PORT",
                   help="gRPC API port (default 8500; 0: any free port, printed when ready)")
    s.add_argument("--host", default="0.0.0.0", help="the address to listen on (default 0.0.0.0: all)")
    s.add_argument("--file-system-poll-wait-seconds", "--file_system_poll_wait_seconds", type=float, default=1.0,
                   metavar="SECONDS", help="how often to look for new versions (default 1)")
    s.add_argument("--threads", type=int, default=8, help="requests run at once (default 8)")
    s.add_argument("--drain-seconds", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, the longest wait for requests in flight (default 30)")
    s.add_argument("--enable-batching", "--enable_batching", action="store_true",
                   help="merge concurrent predict requests into batches (TF Serving's batching parameters and "
                        "defaults)")
    s.add_argument("--batching-parameters-file", "--batching_parameters_file", metavar="FILE",
                   help="with --enable-batching: TF Serving's text-format batching parameters, e.g. "
                        "'max_batch_size { value: 32 } batch_timeout_micros { value: 2000 }'")


def _other_commands(command) -> None:
    ps = command("passes", "list the passes a --pipeline can name, with their options")
    ps.add_argument("--json", action="store_true", help="machine-readable output")

    bo = command("build-ops", "build (or find) vfgraph's MPI ops for this TensorFlow and MPI")
    bo.add_argument("--force", action="store_true", help="build again even if the cache holds them")


def _tf1_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="PREFIX",
                   help="TF1 .meta input: checkpoint prefix (default: the .meta path without .meta)")
    p.add_argument("--loss", default="", metavar="TENSOR",
                   help="TF1 .meta input without a 'train' signature: the loss tensor (default: found from the "
                        "gradient computation)")


def _keras_options(p: argparse.ArgumentParser, fine_tune: bool = False) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help=".keras input: a module to import before loading it (custom layers, losses; repeatable; "
                        "default: none)")
    if not fine_tune:
        return
    p.add_argument("--keras-loss", default="", metavar="NAME",
                   help="an inference SavedModel (model.export(), tf.saved_model.save): a training step with this "
                        "Keras loss, e.g. sparse_categorical_crossentropy (with --keras-optimizer)")
    p.add_argument("--keras-optimizer", default="", metavar="NAME[:K=V,...]",
                   help="with --keras-loss: the Keras optimizer and its arguments, e.g. adam:learning_rate=1e-3")
    p.add_argument("--label", default="label", metavar="NAME",
                   help="with --keras-loss: the name of the training step's label input (default label)")


def _keras_args(args) -> dict:
    """The Keras options of a command, as :func:`vfgraph.load` takes them."""
    return dict(imports=args.imports, keras_loss=args.keras_loss, keras_optimizer=args.keras_optimizer,
                label=args.label)


def _elastic(args) -> bool:
    """Whether this train command runs (or joins) an elastic job."""
    return bool(args.elastic_schedule or args.max_ranks is not None or args.elastic_join or args.host_discovery_script)


def _rank_role(args) -> str:
    """What this rank of ``mpiexec`` runs where the model is cut into pipeline stages on ranks
    (``stage 2 of 2, replica 1``), for the supervisor to name when the rank dies; empty
    otherwise, or when the model's record cannot be read (the worker says why)."""
    try:
        rec = records.read(args.model, Stages).get(args.train_signature)
        rank = int(launcher_rank())
    except (VfgraphError, ValueError):
        return ""
    if rec is None or not rec.on_ranks:
        return ""
    return f"stage {rank % rec.count + 1} of {rec.count}, replica {rank // rec.count + 1}"


class _Unparsed(Exception):
    """What :class:`_TryParser` raises instead of reporting a usage mistake."""


class _TryParser(_Parser):
    """A parser that raises :class:`_Unparsed` where :class:`_Parser` would report a mistake."""

    def error(self, message: str):
        raise _Unparsed(message)


def _parse(argv: List[str]):
    """The arguments of command line ``argv``, or the exit code of a missing input named here.

    A command with flags made from the passes (rewrite, inspect) reads them from the passes,
    which imports TensorFlow (seconds); a command line that parses without them has its inputs
    checked first, so that a missing one is named at once."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in _PASS_COMMANDS:
        return _parser().parse_args(argv)
    wants_help = any(a == "-h" or (a.startswith("--h") and "--help".startswith(a)) for a in argv)
    try:
        early = None if wants_help else _parser(parser_class=_TryParser).parse_args(argv)
    except _Unparsed:  # (a flag of a pass, or a mistake the full parser reports)
        early = None
    if early is not None:
        try:
            _check_inputs_exist(early)
        except VfgraphError as e:
            _error(f"vfgraph {early.command}: {e.label}: {e}")
            return e.exit_code
    return _parser(command).parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    _quiet_tf()
    args = _parse(sys.argv[1:] if argv is None else [str(a) for a in argv])
    if isinstance(args, int):  # a missing input, named before the passes are read
        return args
    if args.command == "train":
        if _elastic(args):
            from vfgraph.runtime.elastic import survivable_transports

            survivable_transports()  # (before MPI starts, here or in the worker it supervises)
        if args.elastic_join:  # a process a running job started: MPI at once, so that the job goes on
            from vfgraph.ops import toolchain

            toolchain.import_mpi()
            from vfgraph.runtime.elastic import PORT_ENV, connect

            if os.environ.get(PORT_ENV):  # (without it, train says what the option is for)
                connect()
        elif launched_by_mpi() and not is_worker():  # one rank of mpiexec: report how it ends
            return supervise(sys.argv[1:] if argv is None else list(argv), _rank_role(args))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vfgraph: %(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    log.propagate = False
    try:
        _check_inputs_exist(args)
        run = {"rewrite": cmd_rewrite, "inspect": cmd_inspect, "diff": cmd_diff, "verify": cmd_verify,
               "train": cmd_train, "export": cmd_export, "passes": cmd_passes, "build-ops": cmd_build_ops,
               "resize": cmd_resize, "profile": cmd_profile, "serve": cmd_serve}[args.command]
        line = " ".join(["vfgraph", *(sys.argv[1:] if argv is None else map(str, argv))])  # (in its output locks)
        with outputs.command(line):  # the output locks the command takes, held until it ends
            return run(args)
    except Quiet as e:  # another rank reports it
        return e.exit_code
    except VfgraphError as e:
        try:
            _share_early_error(args, e)
        except Quiet as q:
            return q.exit_code
        except VfgraphError as agreed:  # (the same error, named by rank when the others did not fail alike)
            e = agreed
        where = f" (rank {e.rank})" if e.rank is not None else ""
        _error(f"vfgraph {args.command}{where}: {e.label}: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        _error("vfgraph: interrupted" + (f"; the last checkpoint in {os.path.abspath(args.output)}.ckpt (if any) "
                                         "is kept: run the same command with --resume to continue"
                                         if args.command == "train" else "; nothing was written"))
        return 130
    except Exception as e:  # noqa: BLE001 - not a user's mistake: one line, and the traceback with -v
        if args.verbose:
            traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _error(f"vfgraph {args.command}: internal error: {type(e).__name__}: {first[:300]}; this is a bug in vfgraph "
               "(or TensorFlow): please report it with the command line" + ("" if args.verbose else
                                                                            " (-v prints the traceback)"))
        return 3


INPUT_PATHS = ("model", "a", "b", "original", "rewritten")  # the commands' positional inputs


def _check_inputs_exist(args) -> None:
    """A missing or unreadable input is named before any command imports TensorFlow (seconds);
    a --data file or --profile that cannot be read, too (a missing one is named by its command)."""
    from vfgraph.io.files import check_readable

    for attr in INPUT_PATHS:
        path = getattr(args, attr, None)
        if path is not None:
            check_readable(path)
    for attr in ("data", "profile"):
        path = getattr(args, attr, None)
        if isinstance(path, str) and path:
            check_readable(path, missing_ok=True)


def _share_early_error(args, e: VfgraphError) -> None:
    """One rank of ``mpiexec`` running ``train`` failed before its ranks first agreed (an option
    or input checked before training starts): agree on it now, in the call the other ranks
    make first, so that it is printed once (raises what :meth:`World.agree` raises). Returns
    at once elsewhere (one process, an elastic job's new rank, or an error the ranks agreed on)."""
    if args.command != "train" or not is_worker() or getattr(args, "elastic_join", False) or agreeing():
        return

    def fail() -> None:
        raise e

    launched_world().agree(fail)


def _error(line: str) -> None:
    """One line on stderr, on a line of its own (a progress bar or another rank may have left
    the cursor mid-line)."""
    sys.stderr.write(("\n" if launched_by_mpi() else "") + line + "\n")
    sys.stderr.flush()


def cmd_rewrite(args) -> int:
    with _flags_named() if args.pipeline is None else contextlib.nullcontext():  # (a pipeline names its passes)
        return _rewrite(args)


def _rewrite(args) -> int:
    if args.pipeline is not None:
        given = [f for f, v in (("--vnodes", args.vnodes), ("--vnode-batch", args.vnode_batch)) if v is not None]
        if given:
            raise InputError(f"{' and '.join(given)} with --pipeline: give the virtual nodes in the pipeline "
                             "instead, e.g. 'split-vnodes{vnodes=8,vnode-batch=4},microbatch-inference'")
        from vfgraph.passes.base import parse_pipeline

        parse_pipeline(args.pipeline)  # a malformed spec is reported before any work
    options = _rewrite_options(args, _check_pass_flags(args))
    from vfgraph.io.keras_file import check_fine_tune_options

    check_fine_tune_options(args.keras_loss, args.keras_optimizer, args.label)  # before any work
    vnodes = options.get("vnodes", _default("split-vnodes", "vnodes"))
    stem, ext = os.path.splitext(os.path.normpath(args.model))
    out = args.output or (stem + f"_vf{ext}" if ext in (".pb", ".pbtxt") else
                          stem + ("" if ext in (".meta", ".keras") else ext) + f"_vnodes{vnodes}")
    inputs = [args.model]
    if args.model.endswith(".meta") or args.checkpoint:  # and the checkpoint's files
        from vfgraph.io.checkpoint import checkpoint_files

        inputs += [f for f in checkpoint_files(args.checkpoint or args.model[:-len(".meta")]) if os.path.exists(f)]
    outputs.lock(out, inputs)
    outputs.check_output(out, inputs, args.force, need_bytes=outputs.tree_bytes(*inputs))
    after = None
    if args.print_after_all:
        from vfgraph.ir.canonical import canonical_text

        def after(p, item):
            print(f"// ----- after {p.spec()}")
            print(canonical_text(item))
    item = vfgraph.rewrite(args.model, pipeline=args.pipeline, after_each=after, allreduce=args.allreduce,
                           outputs=args.outputs.split(",") if args.outputs else None, checkpoint=args.checkpoint,
                           loss=args.loss, verify_each=args.verify_each, **options, **_keras_args(args))
    path = vfgraph.save(item, out, force=args.force)
    for note in item.metadata.get("notes", []):
        print(f"note: {note}", file=sys.stderr)
    reduced = bool(records.get(item, Allreduce))
    print(f"wrote {path} (all-reduce: {'mpi' if reduced else 'none'}; {item.metadata['history'][-1]['pipeline']})")
    return 0


def _default(pass_name: str, option: str):
    """The default of pass ``pass_name``'s option ``option`` (its field's name), as declared."""
    from vfgraph.passes.base import get_pass_class

    return getattr(get_pass_class(pass_name), option)


def _check_pass_flags(args) -> Dict[str, object]:
    """The flags made from the passes' options (:func:`_pass_flags`) the command line gives,
    as ``{dest: value}``, each checked by the declarations of the options it sets: a value one
    refuses is an :class:`InputError` naming the flag (``--vnodes 0: out of range; ...``)."""
    given = {}
    for f in getattr(args, "pass_flags", ()):
        value = getattr(args, f.dest)
        if value is None or value is False:  # (not given)
            continue
        refused = f.problem(value)
        if refused is not None:
            raise InputError(f"{f.flag} {_flag_value(value)}: {refused.problem}")
        given[f.dest] = value
    return given


def _flag_value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _rewrite_options(args, given: Dict[str, object]) -> dict:
    """:func:`vfgraph.rewrite`'s options from the passes' flags ``given``: each as the value of
    the option it sets, partition-stages' as :func:`_partition_options` makes them. A flag of a
    pass the rewrite runs only in a --pipeline is refused, naming the pipeline to give."""
    import inspect

    takes = inspect.signature(vfgraph.rewrite).parameters
    for f in args.pass_flags:
        if f.dest in given and f.dest not in takes:
            pass_name, field = f.sets[0]
            raise InputError(f"{f.flag} {_flag_value(given[f.dest])}: 'vfgraph rewrite' runs pass {pass_name!r} "
                             f"only in a pipeline; give it there, e.g. --pipeline "
                             f"'{pass_name}{{{field.replace('_', '-')}={_flag_value(given[f.dest])}}}'")
    staged = {f.dest for f in args.pass_flags if {p for p, _ in f.sets} == {"partition-stages"}}
    options = {k: v for k, v in given.items() if k not in staged}  # (partition-stages' own: below)
    options.update(_partition_options(args))
    return options


def _check_balance(args, stages) -> None:
    """Check --balance and --profile with --profile-batch and --stages (the profile read, so that
    a bad file is named before any work); afterwards ``args.balance`` is "estimate" or "profile"."""
    if args.profile is not None:
        if args.balance == "estimate":
            raise InputError("--profile with --balance estimate: the cuts balance a profile's times with --balance "
                             "profile (which --profile implies); leave out one of them")
        if args.profile_batch is not None:
            raise InputError(f"--profile-batch with --profile: the profile in {args.profile} is of the batch it was "
                             "measured with; leave out --profile-batch (or profile again with 'vfgraph profile "
                             "--batch N')")
        args.balance = "profile"
    args.balance = args.balance or _default("partition-stages", "balance")
    if args.balance != "estimate" and stages is None and not (args.profile and getattr(args, "memory_budget", None)):
        raise InputError(f"{'--profile' if args.profile is not None else '--balance profile'} without --stages: give "
                         "the number of pipeline stages to balance")
    if args.profile is not None:
        from vfgraph.analysis.profile import read_profile

        read_profile(args.profile)


@contextlib.contextmanager
def _flags_named():
    """A pass option refused by its pass (:class:`OptionError`), set from a flag, is reported as
    that flag (the one the option declares): ``--vnodes 0: out of range; ...``."""
    from vfgraph.passes.base import OptionError, flags

    try:
        yield
    except OptionError as e:
        flag = next((f.flag for f in flags() if (e.pass_name, e.option.replace("-", "_")) in f.sets), None)
        if flag is None:
            raise
        raise InputError(f"{flag} {_flag_value(e.value)}: {e.problem}") from None


def _names(text: Optional[str]) -> List[str]:
    """The names of a comma-separated flag's value (--devices, --split-at), spaces dropped."""
    return [n.strip() for n in text.split(",") if n.strip()] if text else []


def _partition_options(args) -> dict:
    """``vfgraph.rewrite``'s pipeline-stage options from --stages, --devices, --split-at and
    --schedule (checked before any work)."""
    devices, split_at = _names(args.devices), _names(args.split_at)
    _check_balance(args, args.stages if args.stages is not None or devices or split_at else None)
    if args.stages is None and not devices and not split_at:
        return {"schedule": args.schedule} if args.schedule else {}  # (refused by the rewrite: no stages)
    stages = args.stages if args.stages is not None else len(devices)
    if args.pipeline is not None:
        raise InputError("--stages, --devices and --split-at with --pipeline: give them in the pipeline instead, "
                         "e.g. 'partition-stages{stages=2,devices=/GPU:0;/GPU:1},split-vnodes{vnodes=8}'")
    if devices and len(devices) != stages:
        raise InputError(f"--stages {stages} with {len(devices)} device(s): give one device per stage, e.g. "
                         "--devices " + ",".join(f"/GPU:{k}" for k in range(stages)) + " (or none: stage k on MPI "
                         "rank k-1)")
    if split_at and len(split_at) != stages - 1:
        raise InputError(f"--split-at names {len(split_at)} op(s): give the {stages - 1} forward op(s) that start "
                         f"stages 2..{stages}")
    from vfgraph.ir.names import canonical_device  # (vfgraph.ir imports TensorFlow)

    try:
        devices = [canonical_device(d) for d in devices]
    except ValueError as e:
        raise InputError(f"--devices: {e}") from None
    return {"stages": stages, "devices": devices, "split_at": split_at, "schedule": args.schedule,
            "balance": args.balance, "profile_batch": args.profile_batch or args.vnode_batch
            or _default("partition-stages", "profile_batch"), "profile": args.profile or ""}


def cmd_inspect(args) -> int:
    _check_pass_flags(args)
    split_at = _names(args.split_at)
    stages = args.stages if args.stages is not None else (len(split_at) + 1 if split_at else None)
    _check_balance(args, stages)
    item = vfgraph.load(args.model, checkpoint=args.checkpoint, loss=args.loss, **_keras_args(args))
    report, plan = _inspect_report(args, item, stages, split_at)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"model: {item.source}")
    for r in report["history"]:
        print(f"rewritten by vfgraph {r.get('vfgraph_version')}: {r['pipeline']} (source "
              f"{str(r.get('source_fingerprint'))[:16]})")
    for key, e in report["signatures"].items():
        _print_signature(item, key, e)
    if plan is not None:
        _print_stages(plan, report.get("stages_by_estimate"))
    return 0


def _inspect_report(args, item, stages: Optional[int], split_at: List[str]):
    """inspect's report of ``item`` (its JSON) and the stage plan (None without --stages)."""
    from vfgraph.analysis.phases import train_steps

    report = {"model": item.source, "signatures": {}, "rewrites": records.rewrites(item),
              "history": item.metadata.get("history", [])}
    split = records.get(item, VirtualNodes)
    train = item.training_signature(args.train_signature or None)
    if stages is not None:
        _check_stage_target(args, item, train, split)
    plan = None
    for key, sig in sorted(item.signatures.items()):
        g, entry = _signature_entry(item, sig)
        if train is not None and key == train.key and key not in split:
            steps = train_steps(g, sig, stages=stages is not None)  # one per phase of dependent updates
            entry["training"] = _training_entry(sig, steps)
            if stages is not None:
                plan = _plan(args, item, g, sig, steps[0], stages, split_at, report)
        report["signatures"][key] = entry
    return report, plan


def _signature_entry(item, sig):
    """A signature's function graph and inspect's JSON of it (inputs, outputs, variables, ops)."""
    from vfgraph.ir.functions import function_dependencies
    from vfgraph.ir.graph import FunctionGraph

    lib = item.library
    g = FunctionGraph(lib[sig.function], lib)
    hist = collections.Counter(n.op for f in function_dependencies(sig.function, lib) for n in lib[f].node_def)
    return g, {
        "function": sig.function,
        "inputs": {sig.input_keys[a]: g.arg_shape(a) for a in sig.batch_args},
        "outputs": {name: g.shape(ref) for name, ref in g.output_refs()},
        "variables": [sig.variables[r].name for r in sig.resource_args],
        "ops": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def _plan(args, item, g, sig, step, stages: int, split_at: List[str], report: dict):
    """inspect --stages: the stage plan of training step ``step`` (in ``report`` too, with, for
    a profile without --split-at, the estimate's cuts timed by it): the plan ``rewrite --stages``
    makes, with its stages on MPI ranks (no cut where a tensor crosses that messages between
    ranks cannot carry)."""
    from vfgraph.analysis.stages import plan_stages

    profile = None
    if args.balance == "profile":
        from vfgraph.analysis.profile import profile_of

        profile = profile_of(item.source, sig, args.profile_batch or _default("partition-stages", "profile_batch"),
                             args.profile or "")
        if not split_at:  # the estimate's cuts, timed: how far they are from the measured balance
            cuts = plan_stages(g, step, stages, ranks=True).split_at
            report["stages_by_estimate"] = plan_stages(g, step, stages, cuts, profile, ranks=True).to_json()
    plan = plan_stages(g, step, stages, split_at, profile, ranks=True)
    report["stages"] = plan.to_json()
    return plan


def _print_signature(item, key: str, e: dict) -> None:
    """inspect's text of signature ``key`` (its JSON entry ``e``) and of the records of it."""
    rw = records.get(item, VirtualNodes).get(key)
    kind = "training" if "training" in e or rw else "inference"
    print(f"\nsignature {key!r} ({kind}) -> {e['function']}")
    print(f"  inputs:  {', '.join(f'{k}{v}' for k, v in e['inputs'].items())}")
    print(f"  outputs: {', '.join(f'{k}{v if v is not None else [-1]}' for k, v in e['outputs'].items())}")
    print(f"  variables: {len(e['variables'])}")
    if rw:
        _print_vnodes(rw)
    st = records.get(item, Stages).get(key)
    if st:
        _print_stage_parts(st, rw)
    ar = records.get(item, Allreduce).get(key)
    if ar:
        fused = [b for b in ar.buffers[0] if b[0].startswith(VirtualNodes.SUMMED)]
        print(f"  all-reduce over MPI ranks: {len(fused)} fused buffer(s) of at most {ar.fusion_mb:g} MiB "
              f"({sum(map(len, fused))} tensors), {len(ar.buffers[0]) - len(fused)} gathered; "
              f"start with signature {ar.broadcast_signature!r}; graph fingerprint {ar.fingerprint[:16]}")
    elif rw:
        print("  all-reduce: none (each process trains alone; rewrite with --allreduce mpi for mpiexec)")
    if "training" in e:
        _print_training(e["training"])
    top = list(e["ops"].items())[:12]
    print(f"  ops: {', '.join(f'{k} {v}' for k, v in top)}{' ...' if len(e['ops']) > 12 else ''}")


def _print_vnodes(rw) -> None:
    """inspect's text of a signature's virtual nodes (its :class:`VirtualNodes` record ``rw``)."""
    print(f"  virtual nodes: V={rw.vnodes} b={rw.vnode_batch or 'fed batch / V'}"
          + ("; deterministic (exact) sums" if rw.deterministic else ""))
    if rw.memory is not None:
        m, size = rw.memory, outputs.size_text
        print(f"  memory budget: {size(m.budget)} less a {m.margin:.0%} margin: b={m.chosen}; fit {size(m.fixed)} "
              f"+ {size(m.per_example)} per example ({m.source} on {m.device}: "
              + ", ".join(f"{size(p)} at b={b}" for b, p in zip(m.batches, m.peaks)) + ")")
    if rw.accumulate_signature:
        print(f"  step-wise: signatures {rw.accumulate_signature!r} (repeat) and {rw.apply_signature!r}")
    if rw.random_ops:
        from vfgraph.analysis.random_ops import describe

        print(f"  random ops per virtual node: {len(rw.random_ops)}")
        for line in describe(rw.random_ops):
            print(f"    {line}")


def _print_stage_parts(st, rw) -> None:
    """inspect's text of a signature's pipeline stages (its :class:`Stages` record ``st``)."""
    print(f"  pipeline stages: {st.count} ({st.schedule}: at most "
          f"{st.in_flight(rw.vnodes if rw else st.count)} virtual nodes in flight)")
    size = outputs.size_text
    for k, part in enumerate(st.parts, 1):
        cut = f"; {size(st.cut_bytes[k - 1])}/example to stage {k + 1}" if k <= len(st.cut_bytes) else ""
        where = part.device or f"MPI rank {k - 1} (and {k - 1} + {st.count} d for replica d)" + (
            f", signature {st.signatures[k - 1]!r}" if k <= len(st.signatures) else "")
        print(f"    stage {k} on {where}: {part.ops} ops, {len(part.variables)} variables "
              f"({size(part.parameter_bytes)}), optimizer state {size(part.optimizer_state_bytes)}{cut}")


def _check_stage_target(args, item, train, split) -> None:
    """inspect --stages/--split-at: the model has a training signature not yet rewritten."""
    option = "--stages" if args.stages is not None else "--split-at"
    if train is None:
        raise InputError(f"{option}: {item.source} has no training signature "
                         f"{args.train_signature or 'train'!r} to cut into stages (signatures: "
                         f"{', '.join(sorted(item.signatures)) or 'none'}); pass --train-signature NAME")
    if train.key in split:
        raise InputError(f"{option}: signature {train.key!r} was rewritten with virtual nodes already; plan the "
                         "stages of the model before the rewrite")


def _training_entry(sig, steps) -> dict:
    """inspect's JSON of a training step's analysis (``steps``: one per phase)."""
    def name(r: str) -> str:
        return sig.variables[r].name

    entry = {
        "gradients": [{"variable": name(c.variable) if c.variable else None, "tensor": str(c.ref),
                       "shape": c.shape, "role": c.role} for s in steps for c in s.cut],
        "trainable": [name(r) for s in steps for r in s.trainable],
        "batch_dependent_updates": [name(r) for s in steps for r in s.batch_updated],
        "optimizer_state": [name(r) for s in steps for r in s.optimizer_state],
        "per_vnode_nodes": sum(len(s.vnode_nodes) for s in steps),
        "loss_reduction": [s.loss_reduction for s in steps],
        "outputs_over_vnodes": {o.name: ("mean" if o.averaged else "sum") if o.combine == "mean" else o.combine
                                for s in steps for o in s.outputs if o.side == "vnode"},
    }
    if len(steps) > 1:
        entry["phases"] = len(steps)
    return entry


def _print_training(t: dict) -> None:
    """inspect's analysis of a training step (its JSON entry), as text."""
    print("  gradients (tensor -> variable):")
    for gr in t["gradients"]:
        print(f"    {gr['tensor']} {gr['shape']} -> {gr['variable'] or '(' + gr['role'] + ')'}")
    if "phases" in t:
        print(f"  phases: {t['phases']} (dependent updates: each runs over all virtual nodes before the next)")
    how = {"mean": "a mean: virtual nodes' gradients averaged", "sum": "a sum: virtual nodes' gradients summed"}
    print(f"  loss over the batch: {'; '.join(how[r] for r in t['loss_reduction'])}")
    if t["outputs_over_vnodes"]:
        print("  outputs over virtual nodes: " + ", ".join(f"{k} {v}" for k, v in t["outputs_over_vnodes"].items()))
    print(f"  optimizer state: {', '.join(t['optimizer_state']) or 'none'}")
    print(f"  batch-dependent updates: {', '.join(t['batch_dependent_updates']) or 'none'}")


def _print_stages(plan, by_estimate: Optional[dict] = None) -> None:
    """The stage plan as a small table; ``by_estimate``: the estimate's cuts, timed by the same
    profile (JSON), for comparison."""
    how = {"split-at": "split at the given ops", "balanced": "balanced by estimated cost",
           "measured": "balanced by measured time"}[plan.chosen]
    timed = plan.profile_batch > 0
    print(f"\nstages of signature {plan.signature!r}: {len(plan.stages)} ({how}; FLOPs and bytes per example, "
          "estimated from static shapes" + (f"; time per step of {plan.profile_batch} examples, measured on one "
                                            "CPU thread" if timed else "") + ")")
    rows = [("stage", "fwd ops", "bwd ops", "est. FLOPs") + (("time",) if timed else ()) +
            ("params", "opt state", "first op")]
    for st in plan.stages:
        rows.append((str(st.index), str(st.forward_ops), str(st.backward_ops), f"{st.flops:,}")
                    + ((f"{st.measured_ns / 1e6:.2f} ms",) if timed else ())
                    + (f"{len(st.variables)} ({outputs.size_text(st.parameter_bytes)})",
                       f"{len(st.optimizer_state)} ({outputs.size_text(st.optimizer_state_bytes)})", st.first))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  " + "  ".join(cells + [r[-1]]))
    for c in plan.cuts:
        names = ", ".join(t for t, _ in c.tensors[:3]) + (" ..." if len(c.tensors) > 3 else "")
        print(f"  cut {c.index}|{c.index + 1}: {len(c.tensors)} tensor(s), {outputs.size_text(c.bytes)} ({names})")
    share = max(st.flops for st in plan.stages) / max(plan.flops, 1)
    print(f"  largest stage: {share:.0%} of {plan.flops:,} estimated FLOPs")
    if timed:
        total = sum(st.measured_ns for st in plan.stages)
        print(f"  largest stage: {max(st.measured_ns for st in plan.stages) / max(total, 1):.0%} of "
              f"{total / 1e6:.2f} ms measured")
    if by_estimate is not None:
        times = [st["measured_us"] for st in by_estimate["stages"]]
        print(f"  the estimate's cuts ({', '.join(c['before'] for c in by_estimate['cuts'])}) measure "
              + " / ".join(f"{t / 1e3:.2f}" for t in times)
              + f" ms: largest stage {max(times) / max(sum(times), 1e-9):.0%}")
    if plan.replicated:
        print(f"  on every stage: {', '.join(plan.replicated)} ({outputs.size_text(plan.replicated_bytes)})")
    for v in plan.shared:
        print(f"  shared: {v.name} is read by stages {', '.join(map(str, v.stages))} ({outputs.size_text(v.bytes)})")
    placed = ", ".join(f"{n} {k}" for k, n in plan.placement.items() if n)
    print(f"  backward ops placed by: {placed or 'none'}")
    for t, got, want in plan.misplaced:
        print(f"  note: gradient {t} is computed on stage {got}, its variable is on stage {want}")


def cmd_profile(args) -> int:
    from vfgraph.analysis.profile import profile_step, write_profile

    if args.batch < 1 or args.steps < 1:
        bad = ("--batch", args.batch) if args.batch < 1 else ("--steps", args.steps)
        raise InputError(f"{bad[0]} {bad[1]}: give at least 1")
    if not args.output.endswith(".json"):
        raise InputError(f"-o {args.output}: a profile is a JSON file; give a path ending in .json")
    outputs.lock(args.output, [args.model])
    out = outputs.check_output(args.output, [args.model], args.force, what="profile")
    item = vfgraph.load(args.model)
    sig = item.training_signature(args.train_signature or None)
    if sig is None:
        raise InputError(f"{args.model}: no training signature {args.train_signature or 'train'!r} to profile "
                         f"(signatures: {', '.join(sorted(item.signatures)) or 'none'}); pass --train-signature NAME")
    fixed = _static_batch(item, sig)
    del item
    profile = profile_step(args.model, sig, batch=args.batch, steps=args.steps)
    if not fixed:  # the step's peak memory at a few batches, for --memory-budget
        from vfgraph.analysis.memory import measure_peaks

        profile = dataclasses.replace(profile, memory=measure_peaks(args.model, sig.key, loop=True))
    else:
        print(f"note: no memory measured (for --memory-budget): the batch of {sig.key!r} is fixed at {fixed}",
              file=sys.stderr)
    write_profile(profile, out, model=os.path.abspath(args.model))
    by_op = collections.Counter()
    for node, us in profile.ops.items():
        by_op[profile.kinds.get(node) or "?"] += us
    top = ", ".join(f"{op} {us / 1e3:.2f} ms" for op, us in by_op.most_common(5))
    print(f"wrote {out}: signature {sig.key!r}, a step of {profile.batch} examples in {profile.step_us / 1e3:.2f} ms "
          f"(median of {profile.steps}); most time: {top}" + ("" if profile.memory is None else "; peak memory "
          + ", ".join(f"{outputs.size_text(p)} at b={b}" for b, p in zip(profile.memory.batches,
                                                                           profile.memory.peaks))))
    return 0


def _static_batch(item, sig) -> int:
    """The fixed batch of training signature ``sig`` of ``item`` (0 when it is not fixed)."""
    from vfgraph.analysis.train_step import static_batch
    from vfgraph.ir.graph import FunctionGraph

    return static_batch(FunctionGraph(item.library[sig.function], item.library), sig)


def cmd_diff(args) -> int:
    from vfgraph.diff import diff_models

    d = diff_models(args.a, args.b, graphs_only=args.graphs_only, fromfile=args.a, tofile=args.b)
    sys.stdout.writelines(d.lines)
    return 1 if d.differs else 0


def cmd_verify(args) -> int:
    from vfgraph.testing.compare import compare_models

    if not 0 <= args.rtol < float("inf"):
        raise InputError(f"--rtol {args.rtol:g}: give a finite, non-negative tolerance, e.g. 1e-5")

    data = None
    if args.data:
        from vfgraph.runtime.train import load_npz

        data = load_npz(args.data)
    rep = compare_models(args.original, args.rewritten, steps=args.steps, batch=args.batch_size,
                         data=data, train_signature=args.train_signature)
    for key, err in rep.serving.items():
        print(f"serving {key}: " + (f"max abs output difference {err:.3g}" if err is not None
                                    else "no output is finite (listed below)"))
    for step, la, lb in rep.loss:
        print(f"train step {step}: loss original {la:.6g} rewritten {lb:.6g}")
    if rep.params:
        worst = max(rep.params, key=rep.params.get)
        print(f"parameters after {args.steps} steps: max relative difference {rep.worst_param:.3g} ({worst})")
    for bad in rep.nonfinite:
        print(f"not finite: {bad}")
    if rep.nonfinite:
        print(f"MISMATCH: {len(rep.nonfinite)} outputs or parameters are not finite (listed above), so they cannot "
              "be compared; look for NaN or infinite values in the inputs (--data) or a training step that diverges")
        return 1
    ok = rep.worst_param <= args.rtol
    if not ok and rep.batch_statistics:
        print(f"note: {rep.batch_statistics}")
    print("OK" if ok else f"MISMATCH: parameter difference above --rtol {args.rtol}"
          + (" (expected: batch statistics per virtual node, see the note above)" if rep.batch_statistics else ""))
    return 0 if ok else 1


def cmd_resize(args) -> int:
    from vfgraph.runtime.elastic import request

    path = request(args.output, args.ranks)
    print(f"asked the elastic job writing {os.path.abspath(args.output)} for {args.ranks} ranks ({path}); it takes "
          "the request at its next step or refuses it, and logs which")
    return 0


def cmd_train(args) -> int:
    from vfgraph.runtime.train import train

    from vfgraph.runtime.elastic import ElasticOptions

    elastic = None
    if _elastic(args):
        argv = [a for a in sys.argv[1:] if a != "--elastic-join"]
        elastic = ElasticOptions(args.elastic_schedule or "", args.max_ranks, argv, args.elastic_join, _STARTED,
                                 args.host_discovery_script or "", args.discovery_interval)
    per_rank = args.vnodes_per_rank if args.vnodes_per_rank == "auto" else None
    if args.vnodes_per_rank and not per_rank:
        try:
            per_rank = [int(v) for v in args.vnodes_per_rank.split(",")]
        except ValueError:
            raise InputError(f"--vnodes-per-rank {args.vnodes_per_rank}: give comma-separated integers, e.g. 5,3, "
                             "or auto")
    with _keras_model(args.model, args.imports) as model:
        try:
            res = train(model, args.data, args.steps, args.batch_size, args.output, resume=args.resume,
                        force=args.force, signature=args.train_signature, checkpoint_every=args.checkpoint_every,
                        seed=args.seed, progress=not args.no_progress, vnodes_per_rank=per_rank,
                        threads=args.threads, allow_nonfinite=args.allow_nonfinite, elastic=elastic,
                        stall_warning=args.stall_warning, stall_timeout=args.stall_timeout,
                        eval_data=args.eval_data, eval_every=args.eval_every, logdir=args.logdir,
                        keras_file=args.model if model != args.model else None, imports=args.imports or (),
                        input_fn=args.input_fn)
        except Exception as e:
            if args.elastic_join:  # a new rank of an elastic job: the job goes on without it
                from vfgraph.runtime.elastic import report_failure

                report_failure(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise
    if res is not None:  # rank 0 (or the only process)
        from vfgraph.io.serving import sibling_dir, target_dir

        serve = target_dir(sibling_dir(res.out), 1)
        print(res.summary(serve if os.path.isdir(serve) else ""))
    return 0


@contextlib.contextmanager
def _keras_model(model: str, imports) -> Iterator[str]:
    """``model``, or for a .keras file the SavedModel built from it (the same for the same file,
    so a run resumes), in a temporary directory removed afterwards."""
    from vfgraph.io.keras_file import is_keras_file

    if not is_keras_file(model):
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="vfgraph-keras-") as tmp:
        yield vfgraph.save(vfgraph.load(model, imports=imports), os.path.join(tmp, "model"))


def cmd_export(args) -> int:
    path = vfgraph.export(args.model, args.output, version=args.version, vnode_batch=args.vnode_batch,
                          force=args.force, imports=args.imports)
    rec = (records.read_metadata(path) or {}).get("serving_export", {})
    sliced = rec.get("vnode_batch", {})
    sigs = ", ".join(f"{k} (slices of {sliced[k]})" if k in sliced else k for k in rec.get("signatures", []))
    print(f"wrote {path} (serving only: {sigs})")
    return 0


def cmd_serve(args) -> int:
    from vfgraph.serving.server import ServeOptions, serve, setup_logging

    if bool(args.base_path) == bool(args.model_base_path):
        raise InputError("give the model's base directory once: BASE_PATH or --model-base-path" if args.base_path
                         else "give the model's base directory: BASE_PATH (or --model-base-path)")
    if args.batching_parameters_file and not args.enable_batching:
        raise InputError(f"--batching-parameters-file {args.batching_parameters_file}: add --enable-batching (the "
                         "file sets how requests are batched)")
    batching = None
    if args.enable_batching:
        from vfgraph.serving.batching import BatchingParameters

        batching = (BatchingParameters.read(args.batching_parameters_file) if args.batching_parameters_file
                    else BatchingParameters())
    opts = ServeOptions(args.base_path or args.model_base_path, args.model_name, args.rest_port, args.grpc_port,
                        args.host, args.file_system_poll_wait_seconds, args.threads, args.drain_seconds, batching)
    setup_logging()
    if args.verbose:
        logging.getLogger("vfgraph.serve").setLevel(logging.INFO)
    return serve(opts)


def cmd_passes(args) -> int:
    from vfgraph.passes.base import describe, registered

    passes = [describe(cls) for cls in registered().values()]
    if args.json:
        print(json.dumps(passes, indent=2, sort_keys=True))
        return 0
    for i, d in enumerate(passes):
        contract = [f"{k} {', '.join(d[k])}" for k in ("requires", "produces") if d[k]]
        print(("\n" if i else "") + d["name"] + (f"  ({'; '.join(contract)})" if contract else ""))
        print(textwrap.fill(d["summary"], 88, initial_indent="  ", subsequent_indent="  "))
        for o in d["options"]:
            flag = f", {o['flag']}" if o["flag"] else ""
            head = f"    {o['name']}={_option_text(o['default'])} ({o['type']}{flag})"
            if len(head) > 34 and o["help"]:  # (the help on lines of its own)
                print(head)
                head = ""
            print(textwrap.fill(o["help"], 88, initial_indent=head.ljust(34) + " ", subsequent_indent=" " * 35,
                                break_on_hyphens=False) if o["help"] else head)
    return 0


def _option_text(v) -> str:
    return (str(v).lower() if isinstance(v, bool) else str(v)) if v != "" else "''"


def cmd_build_ops(args) -> int:
    from vfgraph.ops import build_ops_main

    return build_ops_main(["--force"] if args.force else [])


if __name__ == "__main__":
    sys.exit(main())
