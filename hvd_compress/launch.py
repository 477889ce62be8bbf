"""Compression for Horovod scripts that do not import hvd_compress.

Two ways in, one mechanism:

    python -m hvd_compress --compression topk,k=0.01,ef=vanilla train.py --epochs 90
    HVD_COMPRESSION=onebit,ef=vanilla python train.py     # with hvd_compress installed

Both validate the spec first (a bad one ends the process before the script runs, with the
Python API's message), then install a post-import hook on Horovod's framework modules. When the
script imports `horovod.torch`, `horovod.tensorflow`, `horovod.tensorflow.keras` or
`horovod.keras`, that module's `DistributedOptimizer` / `DistributedGradientTape` are replaced by
wrappers that take Horovod's arguments and build hvd_compress's optimizer or tape with the launch
spec instead of the script's `compression=`. Modules are patched only when the script imports
them, so a TensorFlow script never loads Horovod's torch library, and only inside this process.

The environment variable reaches every rank through `horovodrun` (which forwards the
environment) and `mpirun -x HVD_COMPRESSION`. It acts through `hvd_compress_env.pth`, which the
package installs into site-packages (a copy of hvd_compress/env.pth): a `.pth` line runs at every
interpreter start, and this one imports nothing unless HVD_COMPRESSION is set and non-empty.

At exit, rank 0 prints one summary line per wrapped optimizer or tape, and writes the per-tensor
statistics as JSON with `--stats PATH` (HVD_COMPRESSION_STATS) and as TensorBoard scalars per
step with `--tensorboard DIR` (HVD_COMPRESSION_TENSORBOARD).
"""
from __future__ import annotations

import argparse
import atexit
import builtins
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import runpy
import sys
import types
from dataclasses import dataclass, field

from .spec import CompressionConfig, parse_spec
from .stats import summary_line

ENV_SPEC = "HVD_COMPRESSION"
ENV_MIN_BYTES = "HVD_COMPRESSION_MIN_BYTES"
ENV_STATS = "HVD_COMPRESSION_STATS"
ENV_TENSORBOARD = "HVD_COMPRESSION_TENSORBOARD"
DEFAULT_MIN_COMPRESS_BYTES = 65536  # the frontends' default

# module -> (attribute, what replaces it): the frontend function that takes Horovod's arguments.
_TARGETS = {
    "horovod.torch": (("DistributedOptimizer", "hvd_compress.torch:DistributedOptimizer"),),
    "horovod.tensorflow": (
        ("DistributedOptimizer", "hvd_compress.tensorflow:DistributedOptimizer"),
        ("DistributedGradientTape", "hvd_compress.tensorflow:DistributedGradientTape")),
    "horovod.tensorflow.keras": (
        ("DistributedOptimizer", "hvd_compress.tensorflow.keras:DistributedOptimizer"),),
    "horovod.keras": (
        ("DistributedOptimizer", "hvd_compress.tensorflow.keras:DistributedOptimizer"),),
}


@dataclass
class Settings:
    config: CompressionConfig
    min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES
    stats_path: str | None = None
    tensorboard: str | None = None
    source: str = "--compression"  # where the spec came from, for the log line


@dataclass
class _Wrapped:
    api: str
    target: object  # has compression_report(); a TF tape's reducer, shared by its tapes


@dataclass
class _Session:
    settings: Settings | None = None
    wrapped: list = field(default_factory=list)
    rank: int = -1
    exit_registered: bool = False


_session = _Session()


def settings_from(spec: str, min_compress_bytes, stats_path, tensorboard, source) -> Settings:
    """Settings from launcher arguments or environment values; ValueError as the API gives."""
    config = parse_spec(spec)
    try:
        min_bytes = int(min_compress_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"min_compress_bytes must be an integer >= 0, got "
                         f"{min_compress_bytes!r}") from None
    if min_bytes < 0:
        raise ValueError(f"min_compress_bytes must be an integer >= 0, got {min_bytes}")
    return Settings(config, min_bytes, stats_path or None, tensorboard or None, source)


def install(settings: Settings) -> None:
    """Patch Horovod's modules as the script imports them (and any already imported)."""
    _session.settings = settings
    if not any(isinstance(f, _HorovodFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HorovodFinder())
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])


def from_environment() -> None:
    """The .pth entry point. A bad spec must stop the run before the script starts: an exception
    from a .pth line is printed and ignored by `site`, and SystemExit there is a fatal error, so
    the message is printed and the process ends with exit code 2."""
    try:
        settings = settings_from(os.environ[ENV_SPEC], os.environ.get(ENV_MIN_BYTES,
                                 DEFAULT_MIN_COMPRESS_BYTES), os.environ.get(ENV_STATS),
                                 os.environ.get(ENV_TENSORBOARD), ENV_SPEC)
    except ValueError as e:
        sys.stderr.write(f"hvd_compress: {ENV_SPEC}: {e}\n")
        sys.stderr.flush()
        os._exit(2)
    install(settings)


class _HorovodFinder(importlib.abc.MetaPathFinder):
    """Finds the targeted modules through the rest of sys.meta_path and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)

    def __getattr__(self, name):  # resource readers and the like stay the real loader's
        return getattr(self._inner, name)


def _patch(module) -> None:
    for attr, ours in _TARGETS[module.__name__]:
        original = getattr(module, attr, None)
        if original is not None and not hasattr(original, "_hvdc_replaces"):
            setattr(module, attr, _replacement(module, attr, original, ours))


def _replacement(module, attr: str, original, ours: str):
    api = f"{module.__name__}.{attr}"
    signature = inspect.signature(original)

    def replacement(*args, **kwargs):
        settings = _session.settings
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{api}(): {e}") from None
        arguments = dict(bound.arguments)
        theirs = arguments.pop("compression", None)
        where, name = ours.split(":")
        build = getattr(__import__(where, fromlist=[name]), name)
        result = build(**arguments, compression=settings.config,
                       min_compress_bytes=settings.min_compress_bytes)
        _track(api, module, result, theirs, settings)
        return result

    replacement.__name__ = replacement.__qualname__ = attr
    replacement.__doc__ = (f"{api}, replaced by hvd_compress's (`python -m hvd_compress` or "
                           f"{ENV_SPEC}): Horovod's arguments, the launch spec.")
    # inspect.unwrap() gives Horovod's own back: hvd_compress's frontends build on it.
    replacement.__wrapped__ = original
    replacement._hvdc_replaces = api
    return replacement


def _track(api: str, module, result, theirs, settings: Settings) -> None:
    target = getattr(result, "_hvdc_reducer", result)
    if any(w.target is target for w in _session.wrapped):
        return  # a tape built again for the next step: same reducer, same statistics
    _session.wrapped.append(_Wrapped(api, target))
    _session.rank = module.rank()
    if _session.rank != 0:
        return
    asked = _compression_name(theirs)
    print(f"hvd_compress: {api} compresses with {settings.config} (from {settings.source}); "
          f"the script's compression={asked} is overridden", file=sys.stderr, flush=True)
    if settings.tensorboard:
        target.write_compression_summaries(settings.tensorboard)
    if not _session.exit_registered:
        # Registered after the framework has registered its own handlers, so it runs before
        # them (atexit is last in, first out) while the statistics can still be read.
        atexit.register(_at_exit)
        _session.exit_registered = True


def _compression_name(compression) -> str:
    if compression is None:
        return "none (Horovod's default)"
    name = getattr(compression, "__name__", None) or type(compression).__name__
    return {"NoneCompressor": "hvd.Compression.none",
            "FP16Compressor": "hvd.Compression.fp16"}.get(name, str(compression))


def _at_exit() -> None:
    reports = [(w.api, w.target.compression_report()) for w in _session.wrapped]
    for api, rep in reports:
        print(summary_line(api, rep), file=sys.stderr, flush=True)
    path = _session.settings.stats_path
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"optimizers": [dict(api=api, **rep) for api, rep in reports]}, f,
                      indent=1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hvd_compress",
        description="Run a Horovod training script with gradient compression: every "
                    "DistributedOptimizer / DistributedGradientTape it builds is hvd_compress's.",
        usage="python -m hvd_compress [--compression SPEC] [--min-compress-bytes N] "
              "[--stats PATH] [--tensorboard DIR] (SCRIPT | -m MODULE) [ARGS ...]")
    p.add_argument("--compression", metavar="SPEC",
                   help=f"compression spec, e.g. topk,k=0.01,ef=vanilla (default: ${ENV_SPEC})")
    p.add_argument("--min-compress-bytes", metavar="N",
                   help=f"gradients under N bytes are allreduced uncompressed "
                        f"(default {DEFAULT_MIN_COMPRESS_BYTES})")
    p.add_argument("--stats", metavar="PATH", help="write per-tensor statistics as JSON (rank 0)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write per-step statistics as TensorBoard scalars (rank 0)")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    # Options stop at the script (or the module after -m): everything after is the script's.
    ours = []
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        ours.append(argv.pop(0))
        if "=" not in ours[-1] and ours[-1] not in ("-h", "--help") and argv:
            ours.append(argv.pop(0))
    if argv and argv[0] == "-m":
        ours += argv[:2]
        argv = argv[2:]
    args = parser.parse_args(ours)
    if args.module is None:
        if not argv:
            parser.error("give the script to run (or -m MODULE)")
        target, argv = argv[0], argv[1:]
    else:
        target = args.module
    spec = args.compression or os.environ.get(ENV_SPEC)
    if not spec:
        parser.error(f"give --compression SPEC (or set {ENV_SPEC})")
    source = "--compression" if args.compression else ENV_SPEC
    try:
        settings = settings_from(
            spec, args.min_compress_bytes or os.environ.get(ENV_MIN_BYTES,
                                                            DEFAULT_MIN_COMPRESS_BYTES),
            args.stats or os.environ.get(ENV_STATS),
            args.tensorboard or os.environ.get(ENV_TENSORBOARD), source)
    except ValueError as e:
        parser.exit(2, f"hvd_compress: {source}: {e}\n")
    install(settings)
    _run(target, argv, as_module=args.module is not None)


def _run(target: str, argv: list[str], as_module: bool) -> None:
    """As `python SCRIPT ARGS` / `python -m MODULE ARGS` would: sys.argv, sys.path[0],
    `__main__`, the exit code; an uncaught exception's traceback starts at the script."""
    if not as_module and not os.path.exists(target):
        sys.stderr.write(f"{sys.executable}: can't open file {os.path.abspath(target)!r}: "
                         f"[Errno 2] No such file or directory\n")
        sys.exit(2)
    sys.argv = [target] + argv
    try:
        if as_module:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif os.path.isfile(target):
            _run_file(target)
        else:  # a directory or zip with __main__.py
            sys.path[0] = os.path.abspath(target)
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        tb = e.__traceback__
        # Drop this launcher's and runpy's frames, as if the script had been run directly.
        while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def _run_file(target: str) -> None:
    """The script becomes `__main__` under its absolute path, as Python does it (runpy would
    put that path in sys.argv[0] too)."""
    path = os.path.abspath(target)
    sys.path[0] = os.path.dirname(path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _is_ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")
