"""Where each op runs and in which format: FP32 islands, the op policy, the layout of FP8/FP32 modules, FSDP."""
