"""The lab: what a profile run measures and how runs compare. Four parts, each depending only on those before it:

record/    what the lab writes and reads again, typed and versioned: every measure's name, unit and meaning
           (measures.py); a profile run's summary.json (run.py), its steps' extract.json.gz (steps.py), compare.json
           (comparison.py), shapes.json (shapes.py); the spread, the noise, the data source and the provenance they hold
measure/   what makes a record: a torch.profiler trace read (trace.py) and measured region by region (analysis.py),
           each step modelled for the pictures (extract.py), the allocator's own figures (allocator.py), the
           machine's load (cpu_load.py); the timing loops, random cases and loss costs of the benches and shapes
present/   what a person reads: tables and numbers (tables.py), verdicts (verdicts.py), the run's card and the
           comparison's markdown (text.py), charts (charts.py), step timelines (timeline.py) and the shape report
           (shapes.py)
the commands, one module each, which detector/cli/main.py composes and none of which imports another: profile.py
           (make profile), compare.py (make compare), report.py (make report), shapes.py (make shapes), curves.py
           (make curves), sweep.py (the strategy sweep)
"""
