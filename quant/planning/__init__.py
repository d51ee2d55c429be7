"""What a quantize run will do, decided before any tensor data is read: the source checkpoint (`source`), the
output schemes (`schemes`), the recipes that give each module role a scheme (`recipes`) and the plan of every
output tensor and shard (`plan`).

Below both the pipeline that carries a plan out (quant.pipeline) and the solver it may hand the weights to
(quant.gptq), which read the same plan; the dry run (quant.gptq.dry_run) resolves recipes and schemes here too.
"""
