"""The eval stage: `quant eval` compares a candidate checkpoint (e.g. MXFP4) with a baseline (e.g. FP8) on
GSM8K and GPQA-Diamond through lm-eval, pairs the answers per question and decides non-inferiority."""
