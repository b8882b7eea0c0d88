"""What a run says of itself: the log line (progress.py), where its wall clock went (wallclock.py), what it
allocates (memory_estimate.py), a profiler window (profile_window.py), and summary.json (summary.py)."""
