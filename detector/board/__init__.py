"""TensorBoard, offline: the event files of profile runs and comparisons (events.py), the launcher
(launcher.py) and the Traces tab (plugin.py, with its page in static/). It draws the lab's records
(detector/lab/) and computes nothing of its own."""
