"""`quant search`: mixed precision under a size budget, read → plan → measure → solve → preview → write.

units.py groups the linears into what an engine forces to share a format; menu.py asks the engine rules which
treatments each unit loads in; sizes.py prices each choice in stored bytes; fisher.py estimates each choice's loss
streaming one decoder layer at a time (the default), sensitivity.py measures it exactly on the whole model;
searched.py holds what was measured (one record) and solves the budget with solver.py's exact knapsack;
loadable.py previews each pick's export with the preflight; recipe_file.py writes the pick as the user recipe
`quant quantize --recipe` takes; plot.py draws the Pareto front; run.py ties them together.
"""
