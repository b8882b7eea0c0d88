"""The lab: what a profile run measures and how runs compare.

From the trace up: trace.py reads a torch.profiler trace; analysis.py measures each step's regions
(measures.py says what each measure means); extract.py models each step for the pictures; record.py is the
run record every reader reads; noise.py records how busy the machine was. verdicts.py judges one run against
another; text.py, charts.py and timeline.py present them. The commands: profile.py (make profile),
compare.py (make compare), report.py (make report), curves.py (make curves), sweep.py (the strategy sweep).
"""
