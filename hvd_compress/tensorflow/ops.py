"""Loads the TensorFlow op library built from csrc/ (once per process)."""
import glob
import os

import tensorflow as tf

_here = os.path.dirname(os.path.abspath(__file__))
_found = sorted(glob.glob(os.path.join(_here, "_ops*.so")))
if not _found:
    raise ImportError("hvd_compress TensorFlow ops are not built: run `make setup` (or "
                      "`pip install -e .` with tensorflow installed)")
lib = tf.load_op_library(_found[0])
