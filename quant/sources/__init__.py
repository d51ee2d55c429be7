"""Source formats: how a checkpoint's stored tensors encode their values, each one object
(source_format.SourceFormat) that recognises its weights from headers, decodes them exactly, writes them (toys,
tests), says which target keeps their bytes and what requantizing them loses. Their data rows are
quant/manifests/source_formats.yaml `encodings` (registry.py reads them); one module per format (mxfp4, fp8_ue8m0,
mxfp8, ct_mxfp4, ct_nvfp4, modelopt_nvfp4, quark_mxfp4, quark_mxfp8, quark_fp8, block_fp8) on the behaviour the
encodings share (e2m1_e8m0, e4m3_e8m0, e2m1_e4m3); native.py plans and reads a source's weights through them."""
