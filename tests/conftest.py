import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for ``helpers``
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
