"""`quant search`: mixed precision under a size budget.

units.py groups the linears into what an engine forces to share a format, menu.py asks the engine profiles which
treatments each unit loads in, sizes.py prices each choice in stored bytes, sensitivity.py measures each choice's
loss on calibration text, solver.py picks the best mix exactly (and the Pareto front), run.py ties them together
and writes the pick as a user recipe that `quant quantize --recipe` takes.
"""
