"""Source formats: how a checkpoint's stored tensors encode their values, recognised from headers and decoded
exactly (`microscaled`: native MXFP4 experts and UE8M0-scaled block FP8, as DeepSeek-V4 ships them)."""
