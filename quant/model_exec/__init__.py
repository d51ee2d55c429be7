"""Building and running parts of a checkpoint's model with transformers' own code, one piece at a time: the
decoder stack one layer at a time (`layers.DecoderStack`: GPTQ's calibration; `layers.config_model`: what the
dry run sizes) and the MTP draft layers (`mtp`: GPTQ's solve of the MTP layer, the eval's in-process draft).

Below the pipeline, GPTQ and the eval stage, which all build the model here; above the checkpoint reader
(quant.checkpoint) and the family data (quant.families).
"""
