"""A run's checkpoints behind one door, ``manager.RunCheckpoints``: which steps save (cadence.py), the saves off the
step's path (writer.py), what a checkpoint holds (state.py), its files and their checks (files.py)."""
