"""A run's checkpoints, one package behind one door. Code outside it imports two modules of it and no other:

- this one: a run folder's checkpoint seen from outside a run, without the model's code (the `train` command begins
  its checks here before the compiler is imported): ``exists``, ``committed_step``, ``manifest_path``, the checks
  begun early (``Verification``), ``human_bytes``, and the cadence's ``AUTO`` and ``interval_steps``;
- manager.py: a run's checkpoints, ``RunCheckpoints`` (``resume``, ``start``, ``due``, ``save``, ``close``), and what
  reads a checkpoint's state outside a run: ``fingerprint``, ``same_run``, ``saved_strategy``, ``read_model``,
  ``layout``.

Behind them, a module a concern, each importing only those below it: manager.py (the door) → writer.py (the saves off
the step's path) → state.py (what a checkpoint holds and means, the resume) → files.py (the files on disk and their
checks); dcp_io.py (what DCP's save and load are given, imported by writer.py and state.py only where they write or
read) → files.py; cadence.py (which steps save).
"""

from detector.train.checkpoints.cadence import AUTO, interval_steps
from detector.train.checkpoints.files import Verification, committed_step, exists, human_bytes, manifest_path

__all__ = ["AUTO", "Verification", "committed_step", "exists", "human_bytes", "interval_steps", "manifest_path"]
