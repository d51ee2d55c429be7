"""`python -m quant`: the `quant` command (what `torchrun ... -m quant quantize ...` runs on every rank)."""

from quant.cli import main

main()
