"""A Quark MXFP4 export (this tool's, AMD's): uint8 `X.weight` [R, K/2] (even element in the low nibble, as
quant/numerics/mxfp4.py packs) + uint8 `X.weight_scale` [R, K/32], a static `X.input_scale` consumed beside it.
Headed for MXFP4 again, its bytes are carried over as they are."""

from quant.sources.e2m1_e8m0 import Mxfp4Codes


class QuarkMxfp4(Mxfp4Codes):
    """Quark's `X.weight` + `X.weight_scale` MXFP4; no release encoder (a Quark export is what this tool writes)."""
