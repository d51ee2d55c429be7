"""The target schemes (quant.planning.schemes names) a source weight can be carried into without rounding: a format
knows which of them stores its own bytes, the planner only asks (quant.sources sits below planning, so the names
are spelled here)."""

MXFP4_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4")  # Quark MXFP4: uint8 E2M1 pairs + uint8 E8M0 weight_scale per 32
MXFP8_SCHEME = "w_mxfp8_a_mxfp8"  # Quark MXFP8: F8_E4M3 weight + uint8 E8M0 weight_scale per [1, 32]
FP8_BLOCK_SCHEME = "fp8-block"  # the official 128x128 block-FP8 target: F8_E4M3 + F32 weight_scale_inv
FP8_CHANNEL_SCHEME = "fp8"  # Quark per-channel FP8: F8_E4M3 + F32 weight_scale [O]
